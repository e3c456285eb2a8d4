"""Faults around a run: one writer per run directory, nothing the user
wrote is overwritten without --overwrite, corrupt checkpoints are quarantined, and every
user-caused CLI failure is one ``error: ...`` line with exit code 2."""
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import slow_steps
from test_train import _one_thread  # noqa: F401  (autouse: one thread for the tiny models)
from whiteformer.app.cli import main
from whiteformer.app.train import ConfigError, TrainConfig, train
from whiteformer.app.train.checkpoint import list_checkpoints
from whiteformer.app.train.rundir import LOCK_NAME

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX locks and signals")

TINY = {"patch_size": 2, "embed_dim": 16, "depth": 2, "num_heads": 2, "cls_attn_layers": 1}
SUBSPACES = ["--dataset", "subspaces", "data_args={num_train: 128, num_test: 32}", "--model", "tost_t12_p16",
             "model_args={patch_size: 2, embed_dim: 16, depth: 2, num_heads: 2, cls_attn_layers: 1}",
             "--batch-size", "32", "--num-threads", "1", "--no-progress", "--no-report", "--no-tensorboard"]


def tiny_cfg(out, **kw):
    base = dict(model="tost_t12_p16", model_args=dict(TINY), dataset="subspaces",
                data_args={"num_train": 128, "num_test": 32}, steps=8, batch_size=32, lr=2e-3, out=str(out),
                progress=False, tensorboard=False, report=False, log_every=2, ckpt_every=2, keep_last=2)
    base.update(kw)
    return TrainConfig(**base)


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1")


def _cli(*args):
    return [sys.executable, "-m", "whiteformer", *args]


def _wait_for(cond, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            pytest.fail("the run ended too early:\n" + proc.stdout.read().decode())
        time.sleep(0.02)
    pytest.fail("timed out")


def one_error_line(capsys, rc):
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "error: " in lines[0] and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------- item 2: one writer
def test_second_writer_is_refused_naming_the_holder_and_a_killed_holder_frees_the_dir(tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen(slow_steps.command(0.25, "train", *SUBSPACES, "--steps", "2000", "--ckpt-every", "5",
                                                "--out", str(run)), env=slow_steps.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: len(list_checkpoints(run / "checkpoints")) >= 1, first)
        for extra in ([], ["--overwrite"], ["--resume"]):
            second = subprocess.run(_cli("train", *SUBSPACES, "--steps", "4", "--out", str(run), *extra), env=_env(),
                                    capture_output=True, text=True, timeout=120)
            assert second.returncode == 2, second.stderr
            assert "in use by another run" in second.stderr and f"pid {first.pid}" in second.stderr
            assert "Traceback" not in second.stderr
        before = json.loads((run / LOCK_NAME).read_text())
        assert before["pid"] == first.pid and before["command"].startswith("whiteformer train --dataset subspaces")
        assert "--steps 2000" in before["command"]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    # The kernel released the dead holder's lock: the run resumes at once.
    last = int(list_checkpoints(run / "checkpoints")[-1].name.split("_")[1])
    res = train(tiny_cfg(run, steps=last + 1, resume=True, ckpt_every=5, keep_last=3, lr=1e-3,
                         unlimited_length=True))  # the options of the command-line run (its defaults)
    assert res["final_eval"]["n"] == 32


# ----------------------------------------------------------------------------- item 3: no silent overwrite
def test_a_non_run_directory_is_refused_and_overwrite_deletes_only_run_files(tmp_path, capsys):
    out = tmp_path / "mine"
    (out / "final").mkdir(parents=True)
    (out / "final" / "weights.bin").write_bytes(b"precious")
    (out / "config.yaml").write_text("my: notes\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="is not empty .* not a run to resume.*--overwrite"):
        train(tiny_cfg(out, steps=2))
    assert (out / "config.yaml").read_text() == "my: notes\n" and (out / "final" / "weights.bin").is_file()
    assert not (out / LOCK_NAME).exists()  # a refused directory is left as it was
    with pytest.raises(ConfigError, match="is not empty"):
        train(tiny_cfg(out, steps=2, resume=True))
    capsys.readouterr()
    train(tiny_cfg(out, steps=2, overwrite=True))
    said = capsys.readouterr().out
    assert "overwrite: moved" in said and "config.yaml" in said and "notes.txt" not in said
    assert (out / "notes.txt").read_text() == "keep me"  # not a file a run writes: kept
    assert not [p for p in out.iterdir() if p.name.startswith(".overwritten-")]  # deleted once the run finished
    assert not (out / "final" / "weights.bin").exists() and (out / "final" / "model.safetensors").is_file()


def _killed_while_writing(path):
    """What ``atomic_write(path, ...)`` leaves when its process is killed mid-write (SIGKILL)."""
    code = ("import os, signal, sys; from whiteformer._files import atomic_write; "
            "atomic_write(sys.argv[1], lambda tmp: (open(tmp, 'w').write('half'), os.kill(os.getpid(), signal.SIGKILL)))")
    env = dict(_env(), PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    assert subprocess.run([sys.executable, "-c", code, str(path)], env=env).returncode == -signal.SIGKILL


def test_a_run_killed_while_writing_a_file_is_started_again_and_its_temporary_removed(tmp_path, capsys):
    """A run killed while writing ``config.yaml`` (before any checkpoint) left only its lock and
    ``.config.yaml.<random>.tmp``: the next run refused the directory as "not empty ... not a run", and
    the temporary survived ``--resume`` and ``--overwrite`` for good."""
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text("{}")
    _killed_while_writing(out / "config.yaml")
    assert [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    train(tiny_cfg(out, steps=2))
    _killed_while_writing(out / "report.md")
    _killed_while_writing(out / "notes.txt")  # not a run's file: the user's, kept
    train(tiny_cfg(out, steps=3, resume=True))
    left = [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 1 and left[0].startswith(".notes.txt.") and (out / "final" / "model.safetensors").is_file()


def test_a_run_that_never_checkpointed_starts_again_and_a_failed_start_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError):
        train(tiny_cfg(out, batch_size=4096))  # fails after the lock, before writing anything
    assert not out.exists()
    out.mkdir()
    (out / LOCK_NAME).write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')  # a run killed before its first checkpoint
    train(tiny_cfg(out, steps=2))
    assert list_checkpoints(out / "checkpoints")


# ----------------------------------------------------------------------------- item 4: corrupt checkpoints
class Crash(RuntimeError):
    pass


def _crash_after(n):
    calls = {"n": 0}

    def hook(model):
        calls["n"] += 1
        if calls["n"] == n:
            raise Crash("simulated crash")

    return hook


def test_all_corrupt_checkpoints_are_quarantined_and_a_second_crash_keeps_progress(tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(run))
    ckpts = list_checkpoints(run / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000006", "step_00000008"]
    for p in ckpts:  # every checkpoint corrupt
        with open(p / "model.safetensors", "r+b") as f:
            f.truncate(100)
    # Resume: nothing valid; it stops naming the quarantined checkpoints (never
    # start over in place of the run to continue).
    with pytest.raises(ConfigError, match="corrupt-step_00000006, checkpoints/corrupt-step_00000008.*--overwrite"):
        train(tiny_cfg(run, resume=True))
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["corrupt-step_00000006", "corrupt-step_00000008"]
    assert (run / "final" / "model.safetensors").is_file()
    # --overwrite starts afresh: crash after 5 steps (checkpoints at 2 and 4 written).
    with pytest.raises(Crash):
        train(tiny_cfg(run, overwrite=True), post_step=[_crash_after(5)])
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000002", "step_00000004"]
    # The second crash did not cost the progress: the next resume starts at step 4.
    with pytest.raises(Crash):
        train(tiny_cfg(run, resume=True), post_step=[_crash_after(1)])
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000002", "step_00000004"]
    res = train(tiny_cfg(run, resume=True))
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 8 and res["final_eval"]["n"] == 32


# ----------------------------------------------------------------------------- item 6: one error line
@pytest.fixture
def vision_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("vision") / "run"
    train(tiny_cfg(run, steps=2))
    return run


def test_disk_full_while_saving_is_one_error_line(tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    import whiteformer.models.save as mc

    def full(*a, **k):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(mc, "write_model_files", full)
    rc = main(["train", *SUBSPACES, "--steps", "2", "--out", str(tmp_path / "run")])
    line = one_error_line(capsys, rc)
    assert "No space left on device" in line and "previous checkpoints are intact" in line


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_impossible_out_is_one_error_line(tmp_path, capsys, where):
    if where == "under_a_file":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "run"
    else:
        out = Path("/proc/whiteformer_run_here")
    rc = main(["train", *SUBSPACES, "--steps", "2", "--out", str(out)])
    assert "cannot create the run directory" in one_error_line(capsys, rc)


def test_truncated_mnist_gz_is_one_error_line(tmp_path, capsys):
    import numpy as np

    d = tmp_path / "mnist"
    d.mkdir()
    for prefix, n in (("train", 64), ("t10k", 16)):
        imgs = np.zeros((n, 28, 28), np.uint8)
        head = np.array([0x803, n, 28, 28], ">i4").tobytes()
        raw = gzip.compress(head + imgs.tobytes())
        (d / f"{prefix}-images-idx3-ubyte.gz").write_bytes(raw[: len(raw) // 2])  # truncated download
        (d / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(np.array([0x801, n], ">i4").tobytes() + np.zeros(n, np.uint8).tobytes()))
    rc = main(["train", "--dataset", "mnist", "--data-dir", str(d), "--steps", "1", "--out", str(tmp_path / "r")])
    assert "cannot build dataset 'mnist'" in one_error_line(capsys, rc)


def test_binary_yaml_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "cfg.yaml"
    bad.write_bytes(b"\xff\xfe\x00\x89PNG\x00\x01")
    rc = main(["train", "-c", str(bad), "--out", str(tmp_path / "r")])
    assert "not a UTF-8 text file" in one_error_line(capsys, rc)


def test_resume_with_another_architecture_is_one_error_line(vision_run, capsys):
    rc = main(["train", *SUBSPACES, "--steps", "4", "model_args.embed_dim=32", "--out", str(vision_run),
               "--resume"])
    assert "different model" in one_error_line(capsys, rc)


def test_eval_of_a_vision_run_on_listops_is_one_error_line(vision_run, capsys):
    rc = main(["eval", "--checkpoint", str(vision_run), "--dataset", "listops"])
    assert "not a language model" in one_error_line(capsys, rc)


def test_malicious_pickle_is_refused_in_one_line_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"state_dict": Evil()}, tmp_path / "evil.pth")
    rc = main(["eval", "--checkpoint", str(tmp_path / "evil.pth"), "--model", "tost_t12_p16",
               "--dataset", "subspaces"])
    assert "refused" in one_error_line(capsys, rc)
    assert not marker.exists()


def test_truncated_model_safetensors_is_one_error_line(vision_run, capsys):
    weights = vision_run / "final" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    try:
        rc = main(["eval", "--checkpoint", str(vision_run / "final")])
        assert "safetensors" in one_error_line(capsys, rc)
    finally:
        weights.write_bytes(data)


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_numbers_are_refused_up_front(tmp_path, capsys, value):
    rc = main(["train", *SUBSPACES, "--steps", "2", "--lr", value, "--out", str(tmp_path / "r")])
    assert "lr must be a finite number" in one_error_line(capsys, rc)
    assert not (tmp_path / "r").exists()
    with pytest.raises(ConfigError, match="finite"):
        TrainConfig(lr=float(value)).validate()


def test_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError):
        main(["train", *SUBSPACES, "--lr", "inf", "--debug", "--out", str(tmp_path / "r")])
    monkeypatch.setenv("WHITEFORMER_DEBUG", "1")
    with pytest.raises(ConfigError):
        main(["train", *SUBSPACES, "--lr", "inf", "--out", str(tmp_path / "r")])
