"""``--resume`` continues a run as it was configured: a change to an option that defines the run is
refused (not silently re-planned and recorded), extending it with more steps still works; the
files a run writes are all in its list of owned files, so ``--overwrite`` replaces every one
."""
import pytest
import yaml

from whiteformer.app.cli import main
from whiteformer.app.config import RUN_DEFINING, ConfigError
from whiteformer.app.train import TrainConfig, train
from whiteformer.app.train.rundir import LOCK_NAME, RUN_FILES

RUN = ["--dataset", "subspaces", "data_args={num_train: 64, num_test: 16}", "--model", "tost_t12_p16",
       "model_args={patch_size: 2, embed_dim: 16, depth: 1, num_heads: 2, cls_attn_layers: 1}",
       "--batch-size", "16", "--steps", "4", "--no-progress", "--no-tensorboard"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "run"
    assert main(["train", *RUN, "--out", str(out)]) == 0
    return out


def _stamps(run):
    """Modification times of the run's files (the lock file aside: every command takes the lock)."""
    return {p.name: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and p.name != LOCK_NAME}


def test_every_file_a_run_writes_is_owned_by_it(finished_run):
    written = {p.name for p in finished_run.iterdir()}
    assert "cls_attention.png" in written and "report.md" in written
    assert written <= set(RUN_FILES), written - set(RUN_FILES)


@pytest.mark.parametrize("argv,names", [
    (["--batch-size", "8", "--seed", "7"], ("batch_size=16", "seed=0", "batch_size=8", "seed=7")),
    (["--lr", "0.01"], ("lr=0.001", "lr=0.01")),
    (["model_args.embed_dim=32"], ("embed_dim",)),
])
def test_resume_refuses_changed_run_options(finished_run, capsys, argv, names):
    before = _stamps(finished_run)
    saved = (finished_run / "config.yaml").read_text()
    assert main(["train", "--out", str(finished_run), "--resume", "--steps", "6", *argv]) == 2
    err = capsys.readouterr().err
    line = err.strip()
    assert "\n" not in line and "error: " in line and "define a run" in line, err
    for n in names:
        assert n in line
    # nothing was re-planned or recorded: the saved configuration and the files are as they were
    assert (finished_run / "config.yaml").read_text() == saved
    assert _stamps(finished_run) == before


def test_resume_still_extends_and_keeps_harmless_options(tmp_path):
    kw = dict(model="tost_t12_p16", model_args={"patch_size": 2, "embed_dim": 16, "depth": 1, "num_heads": 2},
              dataset="subspaces", data_args={"num_train": 64, "num_test": 16}, batch_size=16, progress=False,
              tensorboard=False, report=False, out=str(tmp_path / "run"))
    train(TrainConfig(steps=2, **kw))
    # more steps, another logging / checkpoint cadence and eval batch size: allowed
    res = train(TrainConfig(steps=4, resume=True, log_every=1, ckpt_every=1, keep_last=1, **kw))
    assert res["final_dir"] is not None
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["steps"] == 4
    with pytest.raises(ConfigError, match="seed=0.*seed=3"):
        train(TrainConfig(steps=6, resume=True, **{**kw, "seed": 3}))
    assert {"seed", "batch_size", "model", "model_args", "dataset", "lr"} <= set(RUN_DEFINING)
