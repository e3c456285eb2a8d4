"""Training and evaluation: configuration dataclasses, the training loop (single process or
DDP), fault-tolerant checkpoints, EMA, LR schedule, metrics log and run report.

``train(TrainConfig(...))`` is what ``whiteformer train`` runs; :mod:`.evaluate` holds ``eval`` and
``generate``.
"""
from .checkpoint import CheckpointError, latest_checkpoint, load_training_checkpoint, save_checkpoint, verify_checkpoint
from ..config import AnalyzeConfig, EvalConfig, GenerateConfig, TrainConfig
from ..config import ConfigError, build_config
from .trainer import Trainer, train

__all__ = ["train", "Trainer", "TrainConfig", "EvalConfig", "GenerateConfig", "AnalyzeConfig", "ConfigError",
           "build_config", "CheckpointError", "save_checkpoint", "load_training_checkpoint", "latest_checkpoint",
           "verify_checkpoint"]
