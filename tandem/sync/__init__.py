"""Weight sync: trainer buckets -> inference engine, versioned, checksummed, whole or nothing.

Transports: in-process (colocated), torch.distributed broadcast (gloo on CPU), disk (safetensors,
optional delta), Ray object store, CUDA IPC and cupy NCCL (GPU). See tandem/sync/base.py for the rules.
"""

from tandem.sync.base import SyncConfig, SyncError, SyncUnavailableError, bucketize, checksum
from tandem.sync.inprocess import InProcessSync

__all__ = ["InProcessSync", "SyncConfig", "SyncError", "SyncUnavailableError", "bucketize", "checksum"]
