"""Import-path plugins: ``module.path:function`` strings resolved and checked at start-up.

Security note: resolving a plugin imports and runs the named module, i.e. user code with the
permissions of the Tandem process. Only put import paths you trust in a recipe.

Registries hold the built-ins of one extension point (``advantage: grpo``, ``reward: math``); a
config value is either a registered name or an import path, and `resolve` handles both.

The implementation lives in `tandem.core.registry` (standard library only), so that the core's own
extension points (advantage estimators, policy losses) use the same machinery; this module re-exports
it for everything above the core.
"""

from __future__ import annotations

from tandem.core.registry import PluginError, Registry, load_callable
from tandem.core.registry import check_arity as check_arity  # used by the reward hub

__all__ = ["PluginError", "Registry", "load_callable"]
