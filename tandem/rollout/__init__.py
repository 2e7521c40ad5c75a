"""Generation functions, data sources and synthetic tasks for the loop."""
