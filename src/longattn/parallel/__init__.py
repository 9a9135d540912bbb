"""Sequence parallelism: one sequence split across processes (torch.distributed; torchrun).

Each mechanism with an exact form exchanges only what its algebra needs: sketches whose size does
not depend on N (skeleton's sampled rows and column scores, Nystrom's landmarks, Singularformer's
pseudo tokens, the K^T V sums of the kernel methods) or, for softmax, all keys and values.
See docs/sequence_parallel.md.
"""

from longattn.parallel import kernel, linformer, nystrom, singular, skeleton, softmax  # noqa: F401  (register the forms)
from longattn.parallel.api import (
    SequenceParallelAttention,
    gather_sequence,
    parallel_forms,
    register_form,
    sequence_parallel,
    shard_sequence,
)
from longattn.parallel.comm import CommunicationLog, Shard, count_communication, locate_shard

__all__ = [
    "CommunicationLog",
    "SequenceParallelAttention",
    "Shard",
    "count_communication",
    "gather_sequence",
    "locate_shard",
    "parallel_forms",
    "register_form",
    "sequence_parallel",
    "shard_sequence",
]
