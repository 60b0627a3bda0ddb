"""Checkpoints on threefs: save/load state dicts in seconds (CheckpointManager), torch.distributed
.checkpoint storage (ThreeFSStorageWriter/Reader, threefs.checkpoint.dcp), safetensors files
(threefs.checkpoint.safetensors). docs/checkpoint.md."""

from threefs.checkpoint.manager import CheckpointManager, load_index

__all__ = ["CheckpointManager", "load_index"]
