"""Training: the training loop (single process or DDP), fault-tolerant checkpoints, EMA, metrics
log and run report; the configuration dataclasses are re-exported from :mod:`whiteformer.app.config`.

``train(TrainConfig(...))`` is what ``whiteformer train`` runs; ``eval`` and ``generate`` load a
trained model (:mod:`whiteformer.app.evaluate`).
"""
from .checkpoint import CheckpointError, latest_checkpoint, load_training_checkpoint, save_checkpoint, verify_checkpoint
from ..config import AnalyzeConfig, EvalConfig, GenerateConfig, TrainConfig
from ..config import ConfigError, build_config
from .trainer import Trainer, train

__all__ = ["train", "Trainer", "TrainConfig", "EvalConfig", "GenerateConfig", "AnalyzeConfig", "ConfigError",
           "build_config", "CheckpointError", "save_checkpoint", "load_training_checkpoint", "latest_checkpoint",
           "verify_checkpoint"]
