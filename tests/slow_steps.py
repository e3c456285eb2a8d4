"""``python -m slow_steps SECONDS whiteformer-arguments...``: the ``whiteformer`` command with every
training step followed by a sleep, so that a test can stop or kill a real training process mid-run.

The sleep is patched in here (``Trainer``'s ``train_step``), not shipped as an option of the command.
The subprocess needs ``tests/`` on ``PYTHONPATH`` (:func:`env`).
"""
import os
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def env(**extra) -> dict:
    """The environment of a subprocess that runs this module (tests/ on PYTHONPATH, one thread)."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", **extra)


def command(seconds: float, *args: str) -> list:
    """The argv of a ``whiteformer ARGS`` process whose training steps each sleep ``seconds``."""
    return [sys.executable, "-m", "slow_steps", str(seconds), *args]


def main() -> int:
    from whiteformer.app import cli
    from whiteformer.app.train import trainer

    seconds = float(sys.argv[1])
    step = trainer.train_step

    def slow_step(*args, **kwargs):
        out = step(*args, **kwargs)
        time.sleep(seconds)
        return out

    trainer.train_step = slow_step
    sys.argv = ["whiteformer", *sys.argv[2:]]
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
