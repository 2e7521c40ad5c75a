"""Weight sync: trainer buckets -> inference engine, versioned, checksummed, whole or nothing.

Transports: in-process (colocated), torch.distributed broadcast (gloo on CPU, NCCL on GPU), disk
(safetensors, optional delta), Ray object store, CUDA IPC and cupy NCCL (GPU). Engine side:
`WeightApplier` (the rules every receiver applies) and `EngineReceiver` (a receiving thread in an
engine's process). Optional: quantize-on-send (`QuantizedSender`), ``verify``, and retries with a
fallback transport (`FailoverSender`, ``sync.retries`` / ``sync.fallback``). See docs/sync.md.
"""

from tandem.sync.apply import WeightApplier
from tandem.sync.base import SyncConfig, SyncError, SyncUnavailableError, bucketize, checksum
from tandem.sync.engine_process import EngineReceiver, build_receiver
from tandem.sync.factory import build_sender
from tandem.sync.failover import FailoverSender
from tandem.sync.inprocess import InProcessSync
from tandem.sync.quantize import QuantizedSender
from tandem.sync.verify import VerifyError

__all__ = [
    "EngineReceiver",
    "FailoverSender",
    "InProcessSync",
    "QuantizedSender",
    "SyncConfig",
    "SyncError",
    "SyncUnavailableError",
    "VerifyError",
    "WeightApplier",
    "bucketize",
    "build_receiver",
    "build_sender",
    "checksum",
]
