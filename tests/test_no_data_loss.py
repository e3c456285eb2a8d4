"""Nothing the user has is lost: for every
command that writes (``train``, ``compress``, ``analyze report``, ``analyze eca-toy``, the
``save_pretrained`` of the zoo and of the ``transformers`` wrappers), a directory holding a model or
the user's files comes out unchanged, byte for byte and through symbolic links, unless
``--overwrite`` is given; the read-only commands (``eval``, ``generate``) change nothing."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_faults_runs import SUBSPACES, Crash, _cli, _crash_after, _env, tiny_cfg
from test_train import _one_thread  # noqa: F401  (autouse: one thread for the tiny models)
from whiteformer.app.cli import main
from whiteformer.app.train import train
from whiteformer.app.train.rundir import LOCK_NAME

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX links and pipes")

DEIT = ["--model", "deit_t_p16", "model_args={patch_size: 4, embed_dim: 16, depth: 1, num_heads: 2}", "--dataset",
        "digits", "--steps", "1", "--no-progress", "--no-report", "--no-tensorboard", "--num-threads", "1"]
COMPRESS = ["--qk", "truncatt", "--qk-rank", "2", "--vo", "none", "model_args.drop_rate=0.0"]


def snapshot(root):
    """``{relative path: sha256 of a file | "-> target" of a link | "dir"}`` of everything under
    ``root``, links not followed (the run lock, which records its last holder, left out)."""
    root = Path(root)
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + [f for f in filenames if f != LOCK_NAME]:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def refused(capsys, rc, *words):
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and all(w in err for w in words), err
    return err


def _copy(src, dst):
    shutil.copytree(src, dst, symlinks=True)
    return dst


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run (checkpoints at 1 and 2, final/), copied by each test."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(tiny_cfg(run, steps=2, ckpt_every=1, keep_last=2, log_every=1))
    return run


@pytest.fixture(scope="module")
def deit_run(tmp_path_factory):
    pytest.importorskip("sklearn")
    run = tmp_path_factory.mktemp("deit") / "run"
    assert main(["train", *DEIT, "--out", str(run)]) == 0
    return run


# ----------------------------------------------------------------------------- item 1: finished runs
def test_a_finished_run_is_not_replaced_by_a_new_run(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path / "run")
    new_run = ["train", *SUBSPACES, "--steps", "1", "--seed", "4", "--out", str(run)]
    before = snapshot(run)
    refused(capsys, main(new_run), "already has checkpoints", "--overwrite")
    assert snapshot(run) == before
    shutil.rmtree(run / "checkpoints")  # pruned: only final/ and the logs are left
    before = snapshot(run)
    refused(capsys, main(new_run), "holds a finished run (final/)", "--overwrite")
    refused(capsys, main(["train", "--out", str(run), "--resume"]), "no checkpoint to continue it from")
    assert snapshot(run) == before
    capsys.readouterr()
    assert main([*new_run, "--overwrite"]) == 0  # the flag replaces it; nothing of it is left over
    assert snapshot(run)["final/model.safetensors"] != before["final/model.safetensors"]
    assert not [p for p in run.iterdir() if p.name.startswith(".overwritten-")]


def test_resume_continues_a_finished_run(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path / "run")
    (run / ".tmp-final-99999").mkdir()  # left by a run killed while writing its final model
    (run / ".tmp-final-99999" / "model.safetensors").write_bytes(b"half")
    assert main(["train", "--out", str(run), "--resume", "--steps", "3"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [LOCK_NAME]


def test_resume_replaces_linked_run_files_instead_of_writing_through_them(finished, tmp_path, capsys):
    # the files a run writes beside its model (metrics.csv, report.md/.json, figures) are replaced whole:
    # a link found there is replaced, what it points to stays as it was
    run, elsewhere = _copy(finished, tmp_path / "run"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    names = ("metrics.csv", "report.md", "report.json", "curves.png")
    for name in names:
        (elsewhere / name).write_text(f"the user's own {name}")
        (run / name).unlink(missing_ok=True)
        (run / name).symlink_to(elsewhere / name)
    kept = snapshot(elsewhere)
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--report"]) == 0
    assert snapshot(elsewhere) == kept
    for name in names:
        assert not (run / name).is_symlink() and (run / name).stat().st_size > 0, name
    assert "step" in (run / "metrics.csv").read_text()


def test_every_writing_command_refuses_a_folder_holding_a_model_directly_or_through_a_link(deit_run, tmp_path,
                                                                                             capsys):
    from whiteformer import create_model

    mine = create_model("deit_t_p16", img_size=8, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2,
                        num_classes=10).save_pretrained(tmp_path / "mine")
    (mine / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(mine, target_is_directory=True)
    before = snapshot(tmp_path)
    for out in (mine, tmp_path / "link"):
        for extra in ([], ["--resume"]):
            refused(capsys, main(["train", *SUBSPACES, "--steps", "1", "--out", str(out), *extra]), "is not empty")
        refused(capsys, main(["compress", "--checkpoint", str(deit_run), *COMPRESS, "--out", str(out)]),
                "is not empty")
        refused(capsys, main(["analyze", "eca-toy", "--small", "--no-plots", "--out", str(out)]), "is not empty")
        refused(capsys, main(["analyze", "report", "--checkpoint", str(deit_run), "--out", str(out)]),
                "is not empty")
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- item 3: links
def test_overwrite_never_writes_or_deletes_through_links(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("final", "checkpoints"):  # the run's final/ and checkpoints/ are links to the user's folders
        shutil.move(str(run / name), str(elsewhere / name))
        (run / name).symlink_to(elsewhere / name, target_is_directory=True)
    (elsewhere / "notes.txt").write_text("mine")
    (run / "metrics.csv").unlink()
    (run / "metrics.csv").symlink_to(elsewhere / "notes.txt")
    kept = snapshot(elsewhere)
    assert main(["train", *SUBSPACES, "--steps", "1", "--out", str(run), "--overwrite"]) == 0
    assert snapshot(elsewhere) == kept  # the links were removed, their targets untouched
    assert not (run / "final").is_symlink() and (run / "final" / "model.safetensors").is_file()
    assert not (run / "metrics.csv").is_symlink()
    # Resuming writes the new final/ beside and renames it into place: a link there is replaced too.
    shutil.move(str(run / "final"), str(elsewhere / "final2"))
    (run / "final").symlink_to(elsewhere / "final2", target_is_directory=True)
    kept = snapshot(elsewhere)
    assert main(["train", "--out", str(run), "--resume", "--steps", "2"]) == 0
    assert snapshot(elsewhere) == kept and not (run / "final").is_symlink()


# ----------------------------------------------------------------------------- item 5: shipped configs
def test_a_dangling_metrics_link_is_replaced_not_written_through(finished, tmp_path, capsys):
    """``metrics.jsonl`` is appended to; a dangling link there (``--resume``) made the run create the
    link's target outside the run directory and log into it."""
    run = _copy(finished, tmp_path / "run")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(tmp_path / "outside.jsonl")
    assert main(["train", "--out", str(run), "--resume", "--steps", "3"]) == 0
    assert not (tmp_path / "outside.jsonl").exists() and not (run / "metrics.jsonl").is_symlink()
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3


def test_a_linked_lock_file_is_never_written_through(finished, tmp_path, capsys):
    """The run lock was opened with O_CREAT (links followed), truncated and rewritten with the holder's
    pid and command: a ``.whiteformer-run.lock`` link replaced the user's file it pointed to, even for a
    run refused right after (a dangling link created its target)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = _copy(finished, tmp_path / "run")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for d, target in ((run, victim), (fresh, victim), (tmp_path / "dangling", tmp_path / "created.txt")):
        d.mkdir(exist_ok=True)
        (d / LOCK_NAME).unlink(missing_ok=True)
        (d / LOCK_NAME).symlink_to(target)
        for resume in (False, True):
            rc = main(["train", *SUBSPACES, "--steps", "1", "--out", str(d)] + (["--resume"] if resume else []))
            refused(capsys, rc, LOCK_NAME, "symbolic link")
    assert victim.read_text() == "precious" and not (tmp_path / "created.txt").exists()


def test_no_shipped_config_says_overwrite():
    configs = sorted((Path(__file__).resolve().parents[1] / "src" / "whiteformer" / "app" / "configs").glob("*.y*ml"))
    assert configs
    for path in configs:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert "overwrite" not in cfg and "resume" not in cfg, path


def test_the_demo_passes_overwrite_only_for_its_own_directory():
    from whiteformer.app.demo import demo_overrides

    assert ("overwrite", True) in demo_overrides(["--epochs", "1"])
    for argv in (["--out", "runs/mine"], ["out=runs/mine"], ["--resume"], ["--no-overwrite"]):
        assert ("overwrite", True) not in demo_overrides(argv), argv


# ----------------------------------------------------------------------------- item 6: corrupt checkpoints
def test_resume_with_every_checkpoint_corrupt_stops_and_keeps_final(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path / "run")
    for p in (run / "checkpoints").iterdir():
        with open(p / "model.safetensors", "r+b") as f:
            f.truncate(100)
    final = snapshot(run / "final")
    line = refused(capsys, main(["train", "--out", str(run), "--resume"]), "no intact checkpoint", "--overwrite",
                   "checkpoints/corrupt-step_00000001, checkpoints/corrupt-step_00000002")
    assert len(line.strip().splitlines()) == 1
    # A second attempt is refused the same way (nothing to continue; nothing started over).
    refused(capsys, main(["train", "--out", str(run), "--resume"]), "corrupt-step_00000002")
    refused(capsys, main(["train", *SUBSPACES, "--steps", "1", "--out", str(run)]), "corrupt-step_00000002")
    assert snapshot(run / "final") == final
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["corrupt-step_00000001",
                                                                        "corrupt-step_00000002"]


# ----------------------------------------------------------------------------- item 7: broken pipe, late deletion
def test_output_to_a_closed_pipe_does_not_end_the_run(finished, tmp_path):
    run = _copy(finished, tmp_path / "run")
    old = snapshot(run)["final/model.safetensors"]
    proc = subprocess.Popen(_cli("train", *SUBSPACES, "--steps", "2", "--log-every", "1", "--out", str(run),
                                 "--overwrite"), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # `| head` that has already exited
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    assert b"Broken pipe" not in err and b"Exception ignored" not in err, err.decode()
    assert snapshot(run)["final/model.safetensors"] != old  # the new run finished and replaced the old one


def test_a_failed_overwrite_keeps_the_old_run(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path / "run")
    (run / "notes.txt").write_text("mine")
    before = snapshot(run)
    with pytest.raises(Crash):  # the new run fails at its first step: the old run is back, unchanged
        train(tiny_cfg(run, steps=4, overwrite=True, seed=5), post_step=[_crash_after(1)])
    assert snapshot(run) == before
    assert "back in" in capsys.readouterr().out
    # Once it has checkpointed, a failed new run stays resumable; the old files wait aside until it
    # has its own final model (then they are deleted).
    with pytest.raises(Crash):
        train(tiny_cfg(run, steps=4, overwrite=True, seed=5), post_step=[_crash_after(3)])
    assert "wait in" in capsys.readouterr().out
    assert [p for p in run.iterdir() if p.name.startswith(".overwritten-")]
    assert not (run / "final").exists()
    train(tiny_cfg(run, steps=4, resume=True, seed=5))
    assert not [p for p in run.iterdir() if p.name.startswith(".overwritten-")]
    assert (run / "notes.txt").read_text() == "mine" and (run / "final" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------- item 2: compress
def test_compress_never_writes_into_its_source(deit_run, tmp_path, capsys):
    run = _copy(deit_run, tmp_path / "run")
    (tmp_path / "link").symlink_to(run / "final", target_is_directory=True)
    before = snapshot(tmp_path)
    for ckpt, out in ((run / "final", run / "final"), (run / "final", run), (run, run), (run, tmp_path),
                      (run, run / "final" / "sub"), (run, tmp_path / "link"), (tmp_path / "link", run)):
        for extra in ([], ["--overwrite"]):
            rc = main(["compress", "--checkpoint", str(ckpt), *COMPRESS, "--out", str(out), *extra])
            refused(capsys, rc, "the checkpoint being compressed", "choose another --out")
    rc = main(["compress", "--checkpoint", str(run / "final" / "model.safetensors"), "--model", "deit_t_p16",
               *COMPRESS, "--out", str(run / "final")])  # a weights file: its folder is the source
    refused(capsys, rc, "the checkpoint being compressed")
    assert snapshot(tmp_path) == before


def test_compress_refuses_a_non_empty_out_and_overwrite_keeps_the_other_files(deit_run, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (mine / "model.safetensors").write_bytes(b"my weights")
    (tmp_path / "shared.json").write_text("{}")
    (mine / "config.json").symlink_to(tmp_path / "shared.json")
    before = snapshot(tmp_path)
    refused(capsys, main(["compress", "--checkpoint", str(deit_run), *COMPRESS, "--out", str(mine)]),
            "is not empty", "--overwrite")
    assert snapshot(tmp_path) == before
    assert main(["compress", "--checkpoint", str(deit_run), *COMPRESS, "--out", str(mine), "--overwrite"]) == 0
    after = snapshot(tmp_path)
    assert after["mine/notes.txt"] == before["mine/notes.txt"] and after["shared.json"] == before["shared.json"]
    assert after["mine/model.safetensors"] != before["mine/model.safetensors"]
    assert not (mine / "config.json").is_symlink() and (mine / "compression_report.md").is_file()
    assert sorted(p.name for p in mine.iterdir()) == ["compression_report.json", "compression_report.md",
                                                      "config.json", "model.safetensors", "notes.txt",
                                                      "whiteformer_auto.py"]


def test_compress_killed_mid_write_does_not_block_the_rerun_and_a_live_one_is_named(deit_run, tmp_path, capsys):
    """A command killed while staging its files left a model-sized file behind: the rerun was refused
    ("not empty") and the leftover stayed for good, even after ``--overwrite``. A command still writing
    there is named instead."""
    from whiteformer.app.train.outputs import check_output_dir, staged_output

    out = tmp_path / "out"
    code = ("import os, signal, sys; from whiteformer.app.train.outputs import staged_output\n"
            "with staged_output(sys.argv[1], overwrite=False) as st:\n"
            "    (st / 'model.safetensors').write_bytes(b'half')\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    env = dict(_env(), PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    assert subprocess.run([sys.executable, "-c", code, str(out)], env=env).returncode == -9
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert main(["compress", "--checkpoint", str(deit_run), *COMPRESS, "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["compression_report.json", "compression_report.md",
                                                     "config.json", "model.safetensors", "whiteformer_auto.py"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    busy = tmp_path / "busy"
    with staged_output(busy, overwrite=False) as stage:
        (stage / "x").write_text("being written")
        with pytest.raises(Exception, match="in use by another command"):
            check_output_dir(busy, overwrite=True)
    assert (busy / "x").read_text() == "being written"


# ----------------------------------------------------------------------------- item 4: analyze
def test_analyze_report_refuses_to_overwrite_without_the_flag(finished, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = _copy(finished, tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("my report")
    (out / "curves.png").symlink_to(tmp_path / "run" / "metrics.csv")
    before = snapshot(tmp_path)
    for target in (out, run):
        refused(capsys, main(["analyze", "report", "--checkpoint", str(run), "--out", str(target)]),
                "is not empty", "--overwrite")
    assert snapshot(tmp_path) == before
    assert main(["analyze", "report", "--checkpoint", str(run), "--out", str(out), "--overwrite"]) == 0
    after = snapshot(tmp_path)
    assert after["out/report.md"] != before["out/report.md"] and not (out / "curves.png").is_symlink()
    assert {k: v for k, v in after.items() if k.startswith("run")} == \
        {k: v for k, v in before.items() if k.startswith("run")}
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


def test_analyze_eca_toy_refuses_to_overwrite_without_the_flag(tmp_path, capsys):
    out = tmp_path / "toy"
    out.mkdir()
    (out / "eca_toy.json").write_text("{}")
    before = snapshot(out)
    args = ["analyze", "eca-toy", "--small", "--no-plots", "options.layers=1", "options.epochs=1", "--out", str(out)]
    refused(capsys, main(args), "is not empty", "--overwrite")
    assert snapshot(out) == before
    assert main([*args, "--overwrite"]) == 0
    assert json.loads((out / "eca_toy.json").read_text())["config"]["layers"] == 1
    fresh = tmp_path / "fresh"
    assert main([*args[:-1], str(fresh)]) == 0 and (fresh / "eca_toy.json").is_file()
    assert sorted(p.name for p in fresh.iterdir()) == ["eca_toy.json"]


# ----------------------------------------------------------------------------- read-only commands
def test_eval_and_generate_change_nothing(tmp_path, capsys):
    lm = tmp_path / "lm"
    assert main(["train", "--model", "tost_lm_base", "model_args={dim: 16, depth: 1, num_heads: 2}", "--dataset",
                 "text", "--steps", "1", "--batch-size", "2", "--block-size", "8", "--eval-batches", "1",
                 "--no-report", "--no-progress", "--no-tensorboard", "--num-threads", "1", "--out", str(lm)]) == 0
    before = snapshot(lm)
    assert main(["generate", "--checkpoint", str(lm), "--max-new-tokens", "4"]) == 0
    assert main(["eval", "--checkpoint", str(lm)]) == 0
    assert snapshot(lm) == before


# ----------------------------------------------------------------------------- save_pretrained
def test_save_pretrained_keeps_other_files_and_never_writes_through_links(tmp_path):
    """As ``transformers``' ``save_pretrained``: the files it writes are replaced, the others kept;
    a link in the place of one of them is replaced by the file, its target left alone."""
    from whiteformer import create_model

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "weights.safetensors").write_bytes(b"someone else's weights")
    (outside / "config.json").write_text("{}")
    models = [("zoo", create_model("tost_lm_base", vocab_size=16, dim=16, depth=1, num_heads=2, max_len=8))]
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        import whiteformer.hf  # noqa: F401
    except ImportError:  # the `hf` extra is not installed: the zoo's own save_pretrained only
        AutoConfig = None
    if AutoConfig is not None:
        config = AutoConfig.for_model("whiteformer-tost-lm", model_name="tost_lm_base",
                                      init_kwargs=dict(vocab_size=16, dim=16, depth=1, num_heads=2, max_len=8))
        models.append(("hf", AutoModelForCausalLM.from_config(config)))
    kept = snapshot(outside)
    for name, model in models:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
        (folder / "model.safetensors").symlink_to(outside / "weights.safetensors")
        (folder / "config.json").symlink_to(outside / "config.json")
        model.save_pretrained(folder)
        assert snapshot(outside) == kept, name
        assert (folder / "notes.txt").read_text() == "mine"
        assert not (folder / "model.safetensors").is_symlink() and not (folder / "config.json").is_symlink()
        assert (folder / "model.safetensors").stat().st_size > 1000


def test_save_pretrained_with_a_variant_never_writes_through_links(tmp_path):
    """``save_pretrained(d, variant="fp16", max_shard_size=...)`` wrote its shard index
    ``model.safetensors.index.fp16.json`` through a link of that name into the link's target
    (``transformers`` opens the index with ``open(path, "w")``)."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    import whiteformer.hf  # noqa: F401

    config = AutoConfig.for_model("whiteformer-tost-lm", model_name="tost_lm_base",
                                  init_kwargs=dict(vocab_size=16, dim=16, depth=1, num_heads=2, max_len=8))
    model = AutoModelForCausalLM.from_config(config)
    outside, folder = tmp_path / "outside", tmp_path / "m"
    outside.mkdir()
    folder.mkdir()
    names = ["model.safetensors.index.fp16.json", "model.fp16.safetensors", "config.json", "model.fp32.safetensors"]
    for n in names:
        (outside / n).write_text("theirs")
        (folder / n).symlink_to(outside / n)
    kept = snapshot(outside)
    model.save_pretrained(folder, variant="fp16", max_shard_size="1KB")
    assert snapshot(outside) == kept
    assert json.loads((folder / "model.safetensors.index.fp16.json").read_text())["weight_map"]
    assert (folder / "model.fp32.safetensors").is_symlink()  # not a name this save writes: left alone


# ----------------------------------------------------------------------------- a model folder is one unit
def _tiny_lm(dim, seed):
    import torch

    from whiteformer import create_model

    torch.manual_seed(seed)
    return create_model("tost_lm_base", vocab_size=16, dim=dim, depth=1, num_heads=2, max_len=8)


def _hf_lm(dim, seed):
    import torch

    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    import whiteformer.hf  # noqa: F401

    torch.manual_seed(seed)
    config = AutoConfig.for_model("whiteformer-tost-lm", model_name="tost_lm_base",
                                  init_kwargs=dict(vocab_size=16, dim=dim, depth=1, num_heads=2, max_len=8))
    return AutoModelForCausalLM.from_config(config)


def _save_checkpoint(model, folder):
    from whiteformer.app.train.checkpoint import save_checkpoint

    assert folder.name == "step_00000001"
    save_checkpoint(folder.parent, 1, model, {"optimizer": {}}, keep_last=5)


def _compress_out(model, folder):
    from whiteformer.app.train.outputs import staged_output
    from whiteformer.models.save import write_model_files

    with staged_output(folder, overwrite=True) as stage:
        write_model_files(model, stage)
        (stage / "compression_report.md").write_text(f"report of {model.init_kwargs['dim']}\n")


#: every writer of a model folder: (build a model of width dim, write it into the folder)
WRITERS = {"zoo": (_tiny_lm, lambda m, d: m.save_pretrained(d)),
           "transformers": (_hf_lm, lambda m, d: m.save_pretrained(d)),
           "checkpoint": (_tiny_lm, _save_checkpoint),
           "compress": (_tiny_lm, _compress_out)}


def _model_pair(folder):
    """(config.json, model.safetensors) of a folder, as what a loader reads (None where missing; the
    order of a safetensors header's entries varies from one save to the next)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = (folder / "config.json").read_text() if (folder / "config.json").is_file() else None
    weights = None
    if (folder / "model.safetensors").is_file():
        weights = sorted((k, t.numpy().tobytes()) for k, t in load_file(folder / "model.safetensors").items())
    return config, weights


def _in_child(fn, kill_at=None, file_limit=None, only=""):
    """Run ``fn()`` in a forked process; it is killed (``os._exit``, no clean-up) at its ``kill_at``-th
    rename (``os.rename``, ``os.replace`` or the atomic exchange; of a name holding ``only``), or writes
    under a file-size limit (a full disk: ``EFBIG``). Returns its exit code: 0 done, 1 failed, 9 killed."""
    import resource
    import signal

    import whiteformer._files as files

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            if kill_at is not None:
                calls = [0]

                def counting(real):
                    def wrapper(*a, **kw):
                        calls[0] += any(only in os.path.basename(str(p)) for p in a)
                        if calls[0] == kill_at:
                            os._exit(9)
                        return real(*a, **kw)
                    return wrapper

                os.rename, os.replace, files._exchange = (counting(f) for f in (os.rename, os.replace, files._exchange))
            if file_limit is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))
            fn()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _leftovers(folder):
    """What writers left beside or inside the folder (hidden names other than the user's)."""
    near = [p.name for p in folder.parent.iterdir() if p.name.startswith("." + folder.name)]
    inside = [p.name for p in folder.iterdir() if p.name.startswith(".")] if folder.is_dir() else []
    return near + inside


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_model_folder_is_old_or_new_whole_when_a_save_is_killed_at_any_rename(tmp_path, writer):
    """A kill between the renames of one save left the new config.json with the old weights (the
    folder then loaded as neither model), and safetensors' temporaries in the folder for good."""
    build, save = WRITERS[writer]
    old, new = build(16, 0), build(24, 1)
    folder = tmp_path / "ref" / "step_00000001"
    save(new, folder)
    new_pair = _model_pair(folder)
    k, killed = 1, 0
    while True:
        folder = tmp_path / f"k{k}" / "step_00000001"
        save(old, folder)
        (folder / "notes.txt").write_text("mine")
        old_pair = _model_pair(folder)
        code = _in_child(lambda: save(new, folder), kill_at=k)
        assert _model_pair(folder) in (old_pair, new_pair), (writer, k)
        if code == 0:
            break
        assert code == 9, code
        killed += 1
        save(new, folder)  # the next save: whole, and nothing of the killed one survives it
        assert _model_pair(folder) == new_pair and not _leftovers(folder), (writer, k, _leftovers(folder))
        if writer != "checkpoint":
            assert (folder / "notes.txt").read_text() == "mine"
        k += 1
    assert killed >= 1


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_full_disk_never_breaks_the_model_already_in_the_folder(tmp_path, writer):
    """On a full disk the transformers wrapper wrote config.json, then failed on the weights: the old
    model no longer loaded."""
    build, save = WRITERS[writer]
    old, new = build(16, 0), build(96, 1)
    folder = tmp_path / "m" / "step_00000001"
    save(old, folder)
    before = snapshot(folder.parent)
    limit = (folder / "model.safetensors").stat().st_size + 4096  # the new weights do not fit
    assert _in_child(lambda: save(new, folder), file_limit=limit) == 1
    assert snapshot(folder.parent) == before


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_two_writers_on_one_folder_one_wins_whole_or_the_second_is_refused(tmp_path, writer, monkeypatch):
    """Two processes saving into one folder ended with one model's config and the other's weights."""
    import time

    import whiteformer._files as files

    build, save = WRITERS[writer]
    a, b = build(16, 0), build(24, 1)
    pairs = []
    for m in (a, b):
        save(m, tmp_path / "ref" / m.__class__.__name__ / str(len(pairs)) / "step_00000001")
        pairs.append(_model_pair(tmp_path / "ref" / m.__class__.__name__ / str(len(pairs)) / "step_00000001"))
    real = files._settle
    monkeypatch.setattr(files, "_settle", lambda stage: (time.sleep(0.3), real(stage)))  # the writes overlap
    folder = tmp_path / "m" / "step_00000001"
    pids = []
    for m in (a, b):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                save(m, folder)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    assert 0 in codes and set(codes) <= {0, 1}, codes
    assert _model_pair(folder) in pairs and not _leftovers(folder)
    if codes == [0, 1]:
        assert _model_pair(folder) == pairs[0]


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_model_files_get_the_mode_of_a_new_file(tmp_path, writer):
    """safetensors writes its file 0o600 and renames it over the project's: every model.safetensors
    was -rw------- under umask 022."""
    build, save = WRITERS[writer]
    old = os.umask(0o002)
    try:
        save(build(16, 0), tmp_path / "m" / "step_00000001")
    finally:
        os.umask(old)
    folder = tmp_path / "m" / "step_00000001"
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir()} == \
        {p.name: "0o664" for p in folder.iterdir()}


# ----------------------------------------------------------------------------- --overwrite killed
def _killed_overwrite(run, at_step):
    """``train --overwrite`` killed (no clean-up at all) at its ``at_step``-th step."""
    def kill(model):
        kill.n += 1
        if kill.n == at_step:
            os._exit(9)
    kill.n = 0
    code = _in_child(lambda: train(tiny_cfg(run, steps=4, ckpt_every=2, overwrite=True, seed=5), post_step=[kill]))
    assert code == 9
    assert [p for p in run.iterdir() if p.name.startswith(".overwritten-")] and not (run / "final").exists()


@pytest.mark.parametrize("at_step", [1, 3])
def test_a_killed_overwrite_is_named_by_eval_and_put_back_by_the_next_train(finished, tmp_path, capsys, at_step):
    """A ``train --overwrite`` killed before its final model hid the old run in ``.overwritten-*``:
    ``eval`` said "holds no model", and the next plain ``train`` was accepted and deleted it at its end."""
    run = _copy(finished, tmp_path / "run")
    (run / "notes.txt").write_text("mine")
    before = snapshot(run)
    _killed_overwrite(run, at_step)
    capsys.readouterr()
    if at_step == 1:  # (later, eval reads the stopped run's own checkpoint)
        assert main(["eval", "--checkpoint", str(run)]) == 2
        err = capsys.readouterr().err
        assert ".overwritten-" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1, err
    rc = main(["train", *SUBSPACES, "--steps", "1", "--seed", "2", "--out", str(run)])
    out, err = capsys.readouterr()
    assert rc == 2 and "back in" in out and "--overwrite" in err, (out, err)
    assert snapshot(run) == before


def test_a_killed_overwrite_is_continued_by_resume_and_the_stash_named(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path / "run")
    _killed_overwrite(run, 3)  # after its checkpoint of step 2
    train(tiny_cfg(run, steps=4, ckpt_every=2, resume=True, seed=5))
    out = capsys.readouterr().out
    assert "waits in" in out and "deleted the replaced run's files" in out, out
    assert not [p for p in run.iterdir() if p.name.startswith(".") and p.name != LOCK_NAME]
    assert (run / "final" / "model.safetensors").is_file()


def test_putting_a_replaced_run_back_survives_a_kill_at_any_rename(finished, tmp_path):
    from whiteformer.app.train.rundir import recover_stash

    run = _copy(finished, tmp_path / "stopped")
    before = snapshot(finished)
    _killed_overwrite(run, 3)
    k = 1
    while True:
        again = _copy(run, tmp_path / f"k{k}")
        code = _in_child(lambda: recover_stash(again, resume=False, say=lambda m: None), kill_at=k)
        recover_stash(again, resume=False, say=lambda m: None)
        assert snapshot(again) == before, k
        assert not [p.name for p in again.iterdir() if p.name.startswith(".") and p.name != LOCK_NAME]
        if code == 0:
            break
        assert code == 9
        k += 1
    assert k > 3


def test_train_final_model_is_old_or_new_whole_when_killed_at_any_rename(finished, tmp_path):
    """train's final/: the same staged swap (a kill at each rename touching final/)."""
    before = _model_pair(finished / "final")
    k = 1
    while True:
        run = _copy(finished, tmp_path / f"k{k}")
        code = _in_child(lambda: train(tiny_cfg(run, steps=3, ckpt_every=1, keep_last=2, resume=True)),
                         kill_at=k, only="final")
        pair = _model_pair(run / "final")
        if code == 0:
            assert pair != before
            break
        assert code == 9 and pair == before, k
        train(tiny_cfg(run, steps=3, ckpt_every=1, keep_last=2, resume=True))
        assert _model_pair(run / "final") != before and not [p for p in run.iterdir() if ".final." in p.name]
        k += 1
    assert k >= 2


@pytest.mark.parametrize("errno_name", ["ENOSYS", "EBUSY"])
def test_a_folder_is_replaced_where_the_system_cannot_exchange_two_names(tmp_path, monkeypatch, errno_name):
    """Without renameat2 (ENOSYS) the swap is two renames, the old folder kept as .NAME.*.old until
    the new one is in place (a kill between them is recovered by the next save); a mount point
    (EBUSY) has its entries replaced one by one."""
    import errno

    import whiteformer._files as files

    def cannot(a, b):
        raise OSError(getattr(errno, errno_name), "cannot exchange")

    monkeypatch.setattr(files, "_exchange", cannot)
    old, new = _tiny_lm(16, 0), _tiny_lm(24, 1)
    folder = tmp_path / "ref"
    new.save_pretrained(folder)
    new_pair = _model_pair(folder)
    folder = tmp_path / "m"
    old.save_pretrained(folder)
    (folder / "notes.txt").write_text("mine")
    old_pair = _model_pair(folder)
    if errno_name == "ENOSYS":
        for k in (1, 2):  # killed after moving the old folder aside: the next save puts it back first
            assert _in_child(lambda: new.save_pretrained(folder), kill_at=k) == 9
            assert _model_pair(folder) in ((None, None), old_pair, new_pair)
            old.save_pretrained(folder)
            assert _model_pair(folder) == old_pair and not _leftovers(folder)
    new.save_pretrained(folder)
    assert _model_pair(folder) == new_pair and (folder / "notes.txt").read_text() == "mine"
    assert not _leftovers(folder)
