"""The training loop of ``whiteformer train`` (single process, DistributedDataParallel, or FSDP2
with ``--fsdp``: parameters sharded per block, a whole copy refreshed from the shards to save,
evaluate and report; checkpoints resume across the three).

One optimizer step: fetch the global batch of the step (this process's slice), forward (optional
``--precision`` bf16 / fp16 autocast, fp16 with gradient scaling), cross-entropy (label smoothing)
or the LM loss, backward, gradient clipping, AdamW, warm-up + cosine LR, optional EMA. Every
``log_every`` steps the metrics go to the log; the model is evaluated every epoch (or
``eval_every`` steps) and checkpointed every ``ckpt_every`` steps (or every epoch) and at the
end. ``resume`` restores model, optimizer, scheduler, EMA, RNG states and the step from the
newest valid checkpoint: since the data of a step depends only on ``(seed, step)`` (see
:mod:`.tasks`), a run killed at any moment and resumed ends with the same weights as an
uninterrupted one (same seed, same number of processes, deterministic kernels).

Rank 0 alone writes logs, checkpoints, the final model and the report.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

from ..._files import staged_folder
from ...models.factory import RUN_EMA_MODEL_DIR, RUN_MODEL_DIR
from ...models.save import write_model_files
from ..config import (
    RUN_DEFINING,
    ConfigError,
    TrainConfig,
    amp_precision,
    changed_run_options,
    config_to_dict,
    save_config,
)
from ..schedule import build_scheduler, extend_schedule
from . import distributed as D
from .build import build_datasets, build_model, check_names, describe, make_task
from .checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    list_quarantined,
    remove_stale_temporaries,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .ema import ModelEMA
from .loop import check_finite_weights, train_step
from .metrics import MetricsLogger, truncate_metrics
from .optim import build_optimizer
from .outputs import say as _say
from .rundir import (
    LOCK_NAME,
    check_run_dir,
    drop_stashes,
    no_intact_checkpoint,
    open_run_dir,
    remove_unfinished_finals,
    restore_stash,
    stash_run_files,
)
from .signals import RunInterrupted, StopRequest
from .tasks import seeded_generator, task_class, task_options

__all__ = ["train", "Trainer"]


def _quiet(msg: str) -> None:
    pass


class Trainer:
    """Holds the state of one run; :meth:`fit` trains and returns the results dictionary."""

    def __init__(self, cfg: TrainConfig, dist: D.DistInfo, command: str = "", post_step=()):
        self.cfg = cfg
        self.post_step = list(post_step)
        self.dist = dist
        self.command = command
        self.main = dist.is_main
        self.say = _say if self.main else _quiet
        self.run_dir = Path(cfg.out)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.lock = None
        self.stash = None  # where --overwrite moved the replaced run (deleted once this run has its model)
        if self.main:  # one writer per run directory, for the life of the run
            self.lock, self.dir_mode = open_run_dir(self.run_dir, resume=cfg.resume, overwrite=cfg.overwrite,
                                                    command=command, say=self.say)
        else:
            self.dir_mode = check_run_dir(self.run_dir, resume=cfg.resume, overwrite=cfg.overwrite)
        try:
            self._build()
        except BaseException:
            self.close(failed=True)
            raise

    def close(self, failed: bool = False) -> None:
        """Release the run directory (the OS releases it too if the process dies); a run that
        failed before writing anything leaves no directory behind, and one that replaced a run under
        ``--overwrite`` and failed before its first checkpoint puts the replaced run back."""
        if self.lock is None:
            return
        if failed and self.stash is not None:
            if not list_checkpoints(self.ckpt_dir):
                restore_stash(self.run_dir, self.stash, self.say)
            else:
                self.say(f"overwrite: the replaced run's files wait in {str(self.stash)!r} until this run (continue "
                         f"it with --resume) has written its final model")
            self.stash = None
        if failed and self.dir_mode == "fresh" and [p.name for p in self.run_dir.iterdir()] == [LOCK_NAME]:
            self.lock.path.unlink(missing_ok=True)
            self.lock.release()
            try:
                self.run_dir.rmdir()
            except OSError:
                pass
        self.lock.release()
        self.lock = None

    def _build(self) -> None:
        cfg, dist = self.cfg, self.dist

        torch.manual_seed(cfg.seed)
        self.train_ds, self.eval_ds = build_datasets(cfg.dataset, cfg.data_dir, cfg.data_args, cfg.eval_split)
        if task_class(self.train_ds).requires_steps and cfg.steps <= 0:
            raise ConfigError(f"training on {cfg.dataset!r} needs --steps N (the number of optimizer steps)")
        model = build_model(cfg.model, self.train_ds, cfg.model_args, cfg.finetune, block_size=cfg.block_size,
                            unlimited_length=cfg.unlimited_length)
        self.task = make_task(self.train_ds, self.eval_ds, dist, **task_options(cfg))
        precision = amp_precision(cfg)
        self.task.set_precision(precision)
        self.scaler = torch.amp.GradScaler(dist.device.type) if precision == "fp16" else None
        self.fsdp = cfg.fsdp and dist.enabled  # (one process: nothing to shard, the plain model)
        if self.fsdp and self.post_step:
            raise ConfigError("--fsdp runs no post-step hooks (they need the whole parameters); train without --fsdp")
        self.steps_per_epoch = self.task.steps_per_epoch
        self.total_steps = cfg.steps if cfg.steps > 0 else cfg.epochs * self.steps_per_epoch
        self.warmup = cfg.warmup_steps or int(round(cfg.warmup_epochs * self.steps_per_epoch))

        model = model.to(dist.device)
        if dist.cp_size > 1:
            self._context_parallel(model)
        if dist.enabled:
            model = D.convert_sync_batchnorm(model, dist.device)
        self.module = model  # the plain model (what is saved)
        if self.fsdp:  # train the shards; self.module is a whole copy, refreshed from them to save and evaluate
            import copy

            self.module = copy.deepcopy(model)
            model = D.shard_model(model, precision)
        self.sharded = model if self.fsdp else None
        self.optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
        self.scheduler = build_scheduler(self.optimizer, self.total_steps, self.warmup, cfg.lr, cfg.min_lr,
                                         cfg.schedule)
        self.ema = ModelEMA(model, cfg.ema_decay) if cfg.ema else None
        if dist.enabled and not self.fsdp:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [dist.device.index] if dist.device.type == "cuda" else None
            # One-channel conv weights have ambiguous strides; DDP's (harmless) layout warning is noise.
            warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
            # Buffers (BatchNorm statistics) stay equal across processes through the synchronised
            # BatchNorm, so no per-forward buffer broadcast.
            import inspect

            sync_kw = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
                       else "broadcast_buffers")
            model = DDP(model, device_ids=ids, **{sync_kw: False})
        if cfg.compile:
            model = torch.compile(model)
        self.model = model
        self._prepare_run_dir()  # only now that the configuration is known to work
        self.start_step = 0
        self.prev_train_time = 0.0
        self._resume()

    def _check_tokenizer(self, ckpt: Path) -> None:
        """A resumed language model reads its text with the tokenizer its checkpoint saved: a text
        file changed since (another character set, another trained BPE) would give other ids."""
        from ..data.tokenizer import same_tokenizer

        vocab, saved = getattr(self.train_ds, "vocab", None), ckpt / "tokenizer.json"
        if vocab is None or not hasattr(vocab, "files") or not saved.is_file():
            return
        if not same_tokenizer(vocab.files().get("tokenizer.json", ""), saved.read_text(encoding="utf-8")):
            raise ConfigError(f"--resume: the data's tokenizer is not the one checkpoint {str(ckpt)!r} saved "
                              f"(tokenizer.json): the text file changed since the run began; resume on the same "
                              f"file, or start a new run (another --out, or --overwrite)")

    def _context_parallel(self, model: nn.Module) -> None:
        """Split every sequence over the rank's context-parallel group (language models only; the
        loss is the group's mean, so DDP's gradient mean over all ranks is the unsplit gradient)."""
        if self.task.kind != "lm" or not hasattr(model, "set_context_parallel"):
            raise ConfigError(f"--context-parallel needs a language-model task (text data) and a ToST language "
                              f"model (tost_lm_*); got dataset {self.cfg.dataset!r} and model {self.cfg.model!r}")
        try:
            model.set_context_parallel(self.dist.cp_group)
        except ValueError as err:
            raise ConfigError(str(err)) from err

    # ------------------------------------------------------------------ run directory
    def _prepare_run_dir(self) -> None:
        if self.main:
            remove_unfinished_finals(self.run_dir)
            if self.dir_mode == "clear":
                self.stash = stash_run_files(self.run_dir, self.say)
            remove_stale_temporaries(self.ckpt_dir)
        D.barrier()

    # ------------------------------------------------------------------ resume
    def _resume(self) -> None:
        cfg = self.cfg
        found = latest_checkpoint(self.ckpt_dir, log=self.say, quarantine_corrupt=self.main) if cfg.resume else None
        if cfg.resume and found is None:
            corrupt = list_quarantined(self.ckpt_dir)
            if corrupt:  # never start over in place of the run the user asked to continue
                raise no_intact_checkpoint(self.run_dir, corrupt)
            self.say(f"resume: no valid checkpoint in {str(self.ckpt_dir)!r}; starting from step 0")
        if found is None:
            # Fresh run: a defined RNG stream per process (dropout, drop-path).
            torch.manual_seed(int(seeded_generator(cfg.seed, 4, self.dist.rank).initial_seed()))
            if self.main:
                truncate_metrics(self.run_dir / "metrics.jsonl", -1)
            return
        path, ck = found
        self._check_tokenizer(path)
        st = ck["trainer"]
        changed = changed_run_options(st.get("config"), cfg)
        if changed:
            was = ", ".join(f"{k}={a}" for k, a, _ in changed)
            now = ", ".join(f"{k}={b}" for k, _, b in changed)
            raise ConfigError(f"--resume continues the run of checkpoint {str(path)!r} as it was configured; it was "
                              f"written by a different model or configuration: the run has {was}, this command "
                              f"asks for {now}. These options define a run ({', '.join(RUN_DEFINING)}); resume "
                              f"without them (RUN/config.yaml holds the run's own), extend it with --epochs/--steps, "
                              f"or start a new run (another --out, or --overwrite)")
        step = int(st["step"])
        if step > self.total_steps:
            raise ConfigError(f"checkpoint {str(path)!r} is at step {step}, past this configuration's "
                              f"{self.total_steps} steps; resume with at least as many epochs/steps")
        try:
            self.module.load_state_dict(ck["model"])
            self._load_optimizer(st["optimizer"])
        except (RuntimeError, ValueError, KeyError) as err:
            raise ConfigError(f"checkpoint {str(path)!r} was written by a different model or optimizer "
                              f"configuration than this one ({str(err).splitlines()[0]}); resume with the run's own "
                              f"configuration (whiteformer train --out RUN --resume reads RUN/config.yaml)") from err
        self.scheduler.load_state_dict(st["scheduler"])
        saved = {getattr(fn, "schedule", "cosine") for fn in self.scheduler.lr_lambdas}
        if saved != {cfg.schedule}:
            raise ConfigError(f"checkpoint {str(path)!r} was trained with schedule={','.join(sorted(saved))}, this "
                              f"configuration says schedule={cfg.schedule}; resume with the run's own schedule")
        if st.get("total_steps") not in (None, self.total_steps):
            # Extending (or shortening) a run: the warm-up + cosine schedule is recomputed for the new
            # length and continues from this step, as if the run had been configured so from the start.
            extend_schedule(self.scheduler, self.total_steps)
            self.say(f"resume: the run had {st['total_steps']} steps, now {self.total_steps}; the learning-rate "
                     f"schedule continues over the new length")
        if self.ema is not None:
            if ck["ema"] is None:
                raise ConfigError(f"checkpoint {str(path)!r} has no EMA weights but ema=true")
            self.ema.load_state_dict(ck["ema"])
        if self.scaler is not None and st.get("scaler"):
            self.scaler.load_state_dict(st["scaler"])
        rngs = st["rng"]
        if len(rngs) != self.dist.world_size:
            self.say(f"warning: checkpoint written by {len(rngs)} process(es), now {self.dist.world_size}: "
                     f"the continuation is not bit-exact")
        set_rng_state(rngs[self.dist.rank % len(rngs)])
        self.start_step = step
        self.prev_train_time = float(st.get("train_time_s", 0.0))
        if self.main:
            truncate_metrics(self.run_dir / "metrics.jsonl", self.start_step)
        self.say(f"resumed from {path} (step {self.start_step}/{self.total_steps})")

    def _load_optimizer(self, saved: Dict[str, Any]) -> None:
        """The optimizer state of a checkpoint, written by one process (ids of the parameters) or
        under --fsdp (their names, ``torch.distributed.checkpoint``'s full state dict): either
        resumes either way. Under --fsdp the model's shards are set from the loaded whole model."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True)
        by_name = any(isinstance(p, str) for g in saved.get("param_groups", []) for p in g.get("params", []))
        if not self.fsdp:
            if by_name:
                set_optimizer_state_dict(self.module, self.optimizer, saved, options=full)
            else:
                self.optimizer.load_state_dict(saved)
            return
        set_model_state_dict(self.sharded, self.module.state_dict(), options=full)
        if not by_name:  # ids of the whole model's parameters -> names, through an optimizer of the whole model
            cfg = self.cfg
            whole = build_optimizer(self.module, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
            whole.load_state_dict(saved)
            saved = get_optimizer_state_dict(self.module, whole, options=full)
        set_optimizer_state_dict(self.sharded, self.optimizer, saved, options=full)

    def _whole(self) -> nn.Module:
        """The plain model with the trained weights (under --fsdp gathered from the shards: every
        process must call it)."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            self.module.load_state_dict(get_model_state_dict(self.sharded,
                                                             options=StateDictOptions(full_state_dict=True)))
        return self.module

    def _optimizer_state(self) -> Dict[str, Any]:
        if not self.fsdp:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.sharded, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _save(self, step: int, train_time: float) -> None:
        rngs = D.all_gather_object(rng_state())
        self._whole()
        check_finite_weights(self.module, f"at step {step}; the last checkpoint kept is the previous one")
        optimizer = self._optimizer_state()  # (collective under --fsdp)
        if self.main:
            state = {"optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
                     "rng": rngs, "total_steps": self.total_steps, "steps_per_epoch": self.steps_per_epoch,
                     "world_size": self.dist.world_size, "train_time_s": train_time,
                     "config": config_to_dict(self.cfg),
                     "scaler": self.scaler.state_dict() if self.scaler is not None else None}
            save_checkpoint(self.ckpt_dir, step, self.module, state,
                            self.ema.state_dict() if self.ema is not None else None, self.cfg.keep_last,
                            extra_files=self._extra_files())
        D.barrier()

    def _extra_files(self) -> Dict[str, str]:
        import json

        files = {"train_config.json": json.dumps(config_to_dict(self.cfg), indent=1)}
        vocab = getattr(self.train_ds, "vocab", None)
        if vocab is not None and hasattr(vocab, "files"):  # a language model's tokenizer (transformers' files)
            files.update(vocab.files(getattr(self.module, "context_limit", None)))
        return files

    def _card_section(self, final: Dict[str, float]) -> str:
        """The model card's training section: the command, the data, the final metrics, the configuration."""
        import json

        cfg = self.cfg
        metrics = "\n".join(f"| {k} | {v:.6g} |" for k, v in final.items() if isinstance(v, (int, float)))
        return (f"\n## Training\n\nTrained by `whiteformer train` on `{cfg.dataset}` for {self.total_steps} steps"
                f" ({self.total_steps / self.steps_per_epoch:.3g} epochs).\n\n"
                f"Final evaluation ({cfg.eval_split} split): {self.task.summary(final)}\n\n"
                f"| metric | value |\n|---|---|\n{metrics}\n\n"
                f"Configuration:\n\n```json\n{json.dumps(config_to_dict(cfg), indent=1, sort_keys=True)}\n```\n")

    # ------------------------------------------------------------------ schedule of events
    def _epoch_end(self, done: int) -> bool:
        return self.task.epoch_based and done % self.steps_per_epoch == 0

    def _should_eval(self, done: int) -> bool:
        if done == self.total_steps:
            return True
        if self.cfg.eval_every > 0:
            return done % self.cfg.eval_every == 0
        if self.task.epoch_based:
            return self._epoch_end(done)
        return done % max(1, self.total_steps // 10) == 0

    def _should_ckpt(self, done: int) -> bool:
        if done == self.total_steps:
            return True
        if self.cfg.ckpt_every > 0:
            return done % self.cfg.ckpt_every == 0
        if self.task.epoch_based:
            return self._epoch_end(done)
        return done % max(1, self.total_steps // 10) == 0

    # ------------------------------------------------------------------ training
    def fit(self) -> Dict[str, Any]:
        cfg, dist = self.cfg, self.dist
        t_fit = time.perf_counter()
        n_params, n_str = describe(self.module)
        if self.main:
            save_config(cfg, self.run_dir / "config.yaml")
        self.say(f"run {self.run_dir}: {cfg.model} ({n_str} parameters) on {cfg.dataset} "
                 f"({len(self.train_ds)} train / {len(self.eval_ds)} {cfg.eval_split}), {self.total_steps} steps "
                 f"({self.steps_per_epoch} per epoch), batch {cfg.batch_size}, device {dist.device}"
                 + (f", {dist.world_size} processes" if dist.enabled else "")
                 + (f" (context-parallel {dist.cp_size} x data-parallel {dist.dp_size})" if dist.cp_size > 1 else "")
                 + f", {torch.get_num_threads()} threads")
        recipe = getattr(self.task, "recipe", None)
        if recipe is not None and recipe.active:
            self.say(f"augmentation: {recipe.describe()}")
        logger = MetricsLogger(self.run_dir, enabled=self.main, tensorboard=cfg.tensorboard)
        pbar = None
        if self.main and cfg.progress and sys.stderr.isatty():  # no bar redrawn into log files
            from tqdm.auto import tqdm

            pbar = tqdm(total=self.total_steps, initial=self.start_step, desc="train", dynamic_ncols=True,
                        file=sys.stderr)
        self.model.train()
        t_seg = time.perf_counter()
        stop = StopRequest()
        try:
            with stop:
                last_eval = self._loop(logger, pbar, stop, t_seg, time.perf_counter())
        except BaseException:
            logger.close()
            raise
        if pbar is not None:
            pbar.close()
        self._last_eval = last_eval if self.start_step < self.total_steps else None
        train_time = self.prev_train_time + time.perf_counter() - t_seg
        results = self._finish(logger, train_time)
        results["total_time_s"] = time.perf_counter() - t_fit
        return results

    def _agree(self, *flags: bool):
        """The flags OR-ed over the processes (a signal or a timer seen by one process acts on all)."""
        if not self.dist.enabled:
            return flags
        t = D.all_reduce_sum(torch.tensor([float(f) for f in flags], device=self.dist.device))
        return tuple(bool(v > 0) for v in t.tolist())

    def _loop(self, logger, pbar, stop, t_seg: float, t_ckpt: float) -> Dict[str, float]:
        cfg, task, dev = self.cfg, self.task, self.dist.device
        model = self.model
        acc = torch.zeros(3, dtype=torch.float64, device=dev)  # loss * n, correct, n since the last log record
        line_acc = torch.zeros(3, dtype=torch.float64, device=dev)  # the same since the last progress line
        t_int, n_int = time.perf_counter(), 0
        t_line, n_line = t_int, 0
        last_eval: Dict[str, float] = {}
        for step in range(self.start_step, self.total_steps):
            loss, st, lr = train_step(model, task, self.optimizer, step, clip_grad=cfg.clip_grad,
                                      scheduler=self.scheduler, post_step=self.post_step, hook_model=self.module,
                                      scaler=self.scaler, check_loss=not self.dist.enabled)
            if self.ema is not None:
                self.ema.update(self.module)
            done = step + 1
            cnt = st["count"].double()
            stats = torch.stack([loss.detach().double() * cnt, st.get("correct", torch.zeros((), device=dev)).double(),
                                 cnt])
            acc += stats
            line_acc += stats
            n_int += cfg.batch_size
            n_line += cfg.batch_size
            if pbar is not None:
                pbar.update(1)
            if done % cfg.log_every == 0 or self._epoch_end(done) or done == self.total_steps:
                tot = D.all_reduce_sum(acc.clone())
                mean_loss = (tot[0] / tot[2].clamp_min(1)).item()
                if not math.isfinite(mean_loss):
                    raise FloatingPointError(f"the training loss is {mean_loss} at step {done}; lower --lr or "
                                             f"enable gradient clipping (--clip-grad 1.0)")
                now = time.perf_counter()
                rec = {"step": done, "epoch": round(done / self.steps_per_epoch, 4), "lr": lr,
                       "train_loss": mean_loss, **self._window_metrics(tot, n_int / max(now - t_int, 1e-9))}
                logger.log(rec)
                if pbar is not None:
                    post = {"loss": f"{mean_loss:.3f}"}
                    if "train_acc" in rec:
                        post["acc"] = f"{rec['train_acc']:.3f}"
                    if last_eval:
                        post[f"eval_{task.metric}"] = f"{last_eval[task.metric]:.3f}"
                    post["samples/s"] = f"{rec['samples_per_s']:.0f}"
                    pbar.set_postfix(post)
                acc.zero_()
                t_int, n_int = now, 0
            if self._should_eval(done):
                tot, now = D.all_reduce_sum(line_acc.clone()), time.perf_counter()
                train_line = self._window_metrics(tot, n_line / max(now - t_line, 1e-9))
                line_acc.zero_()
                t_line, n_line = now, 0
                last_eval = task.evaluate(self._eval_model())
                logger.log({"step": done, "epoch": round(done / self.steps_per_epoch, 4),
                            **{f"eval_{k}": v for k, v in last_eval.items()}})
                if pbar is None:
                    self.say(self._progress_line(done, train_line, last_eval))
            timer = cfg.ckpt_minutes > 0 and time.perf_counter() - t_ckpt >= 60 * cfg.ckpt_minutes
            stopping, timer = self._agree(stop.signum is not None, timer)
            if self._should_ckpt(done) or timer or stopping:
                self._save(done, self.prev_train_time + time.perf_counter() - t_seg)
                t_ckpt = time.perf_counter()
            if stopping:
                if pbar is not None:
                    pbar.close()
                signum = stop.signum or signal.SIGTERM
                raise RunInterrupted(f"stopped by {signal.Signals(signum).name} at step {done}/{self.total_steps}; "
                                     f"checkpoint saved: continue with `whiteformer train --out {self.run_dir} "
                                     f"--resume`", signum)
        return last_eval

    def _window_metrics(self, tot: torch.Tensor, samples_per_s: float) -> Dict[str, Any]:
        """Training metrics of a window from its summed ``(loss * n, correct, n)`` (empty when it has no step)."""
        if tot[2].item() <= 0:
            return {}
        rec = {"train_loss": (tot[0] / tot[2]).item(), "samples_per_s": samples_per_s}
        rec.update(self.task.train_metrics({"correct": tot[1].item(), "count": tot[2].item()}))
        return rec

    def _progress_line(self, done: int, train: Dict[str, Any], ev: Dict[str, float]) -> str:
        """One line per evaluation (every epoch by default) when there is no progress bar; ``train``
        holds the training metrics of the steps since the previous line."""
        parts = [f"epoch {done / self.steps_per_epoch:.4g}" if self.task.epoch_based else "",
                 f"step {done}/{self.total_steps}"]
        if "train_loss" in train:
            parts.append(f"train loss {train['train_loss']:.4f}")
        if "train_acc" in train:
            parts.append(f"train acc {100 * train['train_acc']:.2f} %")
        parts.append(f"eval {self.task.summary(ev)}")
        if "samples_per_s" in train:
            parts.append(f"{train['samples_per_s']:.0f} samples/s")
        return " | ".join(p for p in parts if p)

    def _eval_model(self) -> nn.Module:
        return self.ema.module if self.ema is not None else self._whole()

    def _finish(self, logger: MetricsLogger, train_time: float) -> Dict[str, Any]:
        cfg = self.cfg
        check_finite_weights(self._whole(), "at the end of training; no final model was saved")
        final = getattr(self, "_last_eval", None) or self.task.evaluate(self._eval_model())
        results: Dict[str, Any] = {"final_eval": final, "summary": self.task.summary(final),
                                   "train_time_s": train_time}
        if self.ema is not None:
            results["ema_eval"] = final
            results["raw_eval"] = self.task.evaluate(self.module)
        logger.close(csv_path=self.run_dir / "metrics.csv" if self.main else None)
        if self.main:
            extra = self._extra_files()
            for name, mod in ((RUN_MODEL_DIR, self.module), (RUN_EMA_MODEL_DIR, self.ema.module if self.ema else None)):
                if mod is None:
                    continue
                # Written beside, then swapped into place: a link named final/ is replaced, never written through.
                with staged_folder(self.run_dir / name, keep=False) as stage:
                    ev = final if mod is not self.module else results.get("raw_eval", final)
                    write_model_files(mod, stage, card=True, card_extra=self._card_section(ev))
                    for fname, text in extra.items():
                        (stage / fname).write_text(text, encoding="utf-8")
            drop_stashes(self.run_dir, self.say)  # the replaced run goes only now that this one has its model
            info = {"model": cfg.model, "dataset": cfg.dataset, "command": self.command, "eval_split": cfg.eval_split,
                    "steps": self.total_steps, "epochs": round(self.total_steps / self.steps_per_epoch, 2),
                    "params": describe(self.module)[1], "device": str(self.dist.device),
                    "threads": torch.get_num_threads(), "world_size": self.dist.world_size,
                    "run_dir": str(self.run_dir)}
            if cfg.report:
                report_model = self.ema.module if self.ema is not None else self.module  # (whole: synced above)
                if self.dist.cp_size > 1:  # the report's analyses and samples run on this process alone
                    report_model.set_context_parallel(None)
                results["report"] = str(write_report_safe(self.run_dir, report_model, self.task, results, info,
                                                          cfg.report_images, self.say))
            results["final_dir"] = str(self.run_dir / (RUN_EMA_MODEL_DIR if self.ema is not None else RUN_MODEL_DIR))
        D.barrier()
        return results


def write_report_safe(run_dir, model, task, results, info, num_images, say) -> Optional[Path]:
    from .report import write_report

    try:
        return write_report(run_dir, model, task, results, info, num_images)
    except Exception as err:  # noqa: BLE001 - the report must never lose a finished run
        say(f"warning: the run report failed: {type(err).__name__}: {err}")
        return None


def train(cfg: TrainConfig, command: str = "", post_step=()) -> Dict[str, Any]:
    """Run ``whiteformer train`` with a resolved configuration; returns the results dictionary
    (``final_eval``, ``train_time_s``, ``report``, ``final_dir``, ...). ``post_step``: callables
    ``hook(model)`` run after every optimizer step (see :func:`.loop.train_step`)."""
    cfg.validate()
    check_names(cfg.model, cfg.dataset, cfg.data_dir)
    if cfg.finetune is not None and not Path(cfg.finetune).expanduser().exists():
        raise ConfigError(f"finetune checkpoint {cfg.finetune!r} does not exist")
    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        dist = D.setup(cfg.device, cfg.context_parallel)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    try:
        trainer = Trainer(cfg, dist, command, post_step)
        try:
            res = trainer.fit()
        except BaseException:
            trainer.close(failed=True)
            raise
        trainer.close()
        return res
    finally:
        # the trainer holds the (FSDP-sharded) model: dropped here, cleanup's collection frees it
        # before the process group goes
        trainer = None
        D.cleanup()
