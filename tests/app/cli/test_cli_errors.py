"""Every user error of the ``whiteformer`` commands is one ``error: ...`` line with exit code 2,
and options that make no sense are refused instead of silently accepted."""
import pytest

from whiteformer.app.cli import main
from whiteformer.models import create_model

# every train below stops before training (--num-threads left at 0: the thread count is not touched)
TINY = ["model_args={patch_size: 2, embed_dim: 16, depth: 1, num_heads: 2}", "--no-progress", "--no-tensorboard"]


def _one_error_line(capsys, *needles):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0] and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, err)
    return lines[0]


@pytest.fixture(scope="module")
def deit_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("deit") / "orig"
    create_model("deit_t_p16", img_size=8, patch_size=4, in_chans=1, num_classes=10, depth=1, embed_dim=16,
                 num_heads=2).save_pretrained(d)
    return str(d)


def test_unknown_command_prints_an_error_line(capsys):
    assert main(["frobnicate"]) == 2
    _one_error_line(capsys, "unknown command 'frobnicate'", "train")


def test_list_datasets_refuses_arguments(capsys):
    assert main(["list-datasets", "--foo"]) == 2
    _one_error_line(capsys, "--foo")
    assert main(["list-datasets"]) == 0


@pytest.mark.parametrize("command", ["eval", "generate"])
@pytest.mark.parametrize("device", ["gpu7", "tpu"])
def test_unknown_device_is_one_line(tmp_path, capsys, command, device):
    assert main([command, "--checkpoint", str(tmp_path), "--device", device]) == 2
    _one_error_line(capsys, f"got {device!r}", "cuda:N")


@pytest.mark.parametrize("device", ["gpu7", "tpu"])
def test_compress_unknown_device_is_one_line(tmp_path, capsys, deit_dir, device):
    assert main(["compress", "--checkpoint", deit_dir, "--qk-rank", "4", "--device", device,
                          "--out", str(tmp_path / "c")]) == 2
    _one_error_line(capsys, f"got {device!r}")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("device", ["meta", "mps", "xpu"])
def test_a_device_torch_knows_but_cannot_use_here_is_one_line(tmp_path, capsys, deit_dir, device):
    """Each was a traceback from inside a command (autocast on 'meta', 'not linked with support for
    mps devices', 'Torch not compiled with XPU enabled')."""
    pytest.importorskip("sklearn")
    if device == "mps" and __import__("torch").backends.mps.is_available():
        pytest.skip("this machine has MPS")
    for argv in (["eval", "--checkpoint", deit_dir, "--dataset", "digits"],
                 ["train", "--model", "deit_t_p16", "--dataset", "digits", *TINY, "--out", str(tmp_path / "r")]):
        assert main([*argv, "--device", device]) == 2
        _one_error_line(capsys, f"device {device!r} cannot compute in this process", "--device cpu")
    assert main(["compress", "--checkpoint", deit_dir, "--qk-rank", "4", "--device", device,
                          "--out", str(tmp_path / "c")]) == 2
    _one_error_line(capsys, f"device {device!r} cannot compute")
    assert not (tmp_path / "c").exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv,needle", [
    (["--seed", str(2 ** 70)], "seed must be an integer in [0, 2**63 - 1]"),
    (["--report-images", "-1"], "report_images must be >= 0"),
    (["--device", "gpu7"], "device must be"),
    (["--num-threads", "100000"], "num_threads must be in [0, "),  # was SIGSEGV (libgomp from ~32768)
])
def test_train_refuses_out_of_range_options(tmp_path, capsys, argv, needle):
    assert main(["train", *TINY, "--epochs", "1", "--out", str(tmp_path / "r"), *argv]) == 2
    _one_error_line(capsys, needle)
    assert not (tmp_path / "r").exists()


def test_translate_larger_than_the_images_is_refused(tmp_path, capsys):
    assert main(["train", *TINY, "--epochs", "1", "--translate", "100", "--out", str(tmp_path / "r")]) == 2
    _one_error_line(capsys, "translate (100 pixels)", "(8, 8)")


@pytest.mark.parametrize("argv,needle", [
    (["--finetune-epochs", "1", "--dataset", "digits", "--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    (["--finetune-epochs", "1", "--dataset", "digits", "--max-steps", "-3"], "--max-steps must be >= 1, got -3"),
    (["--finetune-epochs", "1", "--dataset", "digits", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--max-steps", "3"], "add --finetune-epochs"),
    (["--seed", str(2 ** 70)], "--seed must be an integer"),
])
def test_compress_refuses_nonsense_counts(tmp_path, capsys, deit_dir, argv, needle):
    assert main(["compress", "--checkpoint", deit_dir, "--qk-rank", "4", *argv, "--out", str(tmp_path / "c")]) == 2
    _one_error_line(capsys, needle)
    assert not (tmp_path / "c").exists()


def test_compress_checkpoint_without_weights(tmp_path, capsys, deit_dir):
    from pathlib import Path

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((Path(deit_dir) / "config.json").read_text())
    assert main(["compress", "--checkpoint", str(bare), "--qk-rank", "4", "--out", str(tmp_path / "c")]) == 2
    _one_error_line(capsys, "has no model.safetensors", str(bare))


def test_eca_toy_unknown_option(tmp_path, capsys):
    assert main(["analyze", "eca-toy", "--small", "bogus=3", "--out", str(tmp_path / "a")]) == 2
    _one_error_line(capsys, "'bogus'", "layers")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("kind", ["dir", "device", "syntax"])
def test_config_file_errors_say_what_is_wrong(tmp_path, capsys, kind):
    path = {"dir": str(tmp_path), "device": "/dev/zero", "syntax": str(tmp_path / "bad.yaml")}[kind]
    (tmp_path / "bad.yaml").write_text("a: 1\nb: [1, 2\nc: 3\n")
    assert main(["train", "-c", path]) == 2
    line = _one_error_line(capsys, path)
    assert {"dir": "is a directory", "device": "not a regular file", "syntax": "line 3"}[kind] in line


@pytest.mark.parametrize("option, needle", [
    ("d=-1", "option d must be an integer >= 1"), ("d=abc", "d must be an integer, got 'abc'"),
    ("alpha=.nan", "alpha must be a number, got '.nan'"), ("eps_sweep=[.nan]", "eps_sweep[0] must be a finite"),
    ("d=100000000", "sizes too large"), ("n=100000000000", "sizes too large"), ("layers=100000000", "at most 1024")])
def test_eca_toy_option_values_are_checked_before_running(tmp_path, capsys, option, needle):
    """Values of known options reached the toy unchecked: a traceback (ValueError, TypeError, a
    LinAlgError) or an allocation of 80 PB."""
    assert main(["analyze", "eca-toy", "--small", option, "--out", str(tmp_path / "a")]) == 2
    _one_error_line(capsys, needle)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("option, needle", [
    ("samples=-1", "samples must be an integer in [1, 4096]"), ("samples=abc", "samples must be an integer"),
    ("samples=100000000000", "samples must be"), ("seq_len=0", "seq_len must be"), ("eps=-1", "eps must be"),
    ("eps=abc", "eps must be a number"), ("subspaces=0", "subspaces must be"), ("features=bogus", "features must be"),
    ("inputs=5", "'5'"), ("subspaces=2", "subspaces and attention_mask apply to transformers models"),
    ("options.samples=0", "samples must be an integer in [1, 4096]")])  # the earlier spelling, still read
def test_layerwise_option_values_are_one_error_line(tmp_path, capsys, deit_dir, option, needle):
    """Each was a traceback (negative dimension, int('abc'), a 25 TB allocation, the report's own
    ValueError) or, for seq_len=0, silently accepted."""
    rc = main(["analyze", "layerwise", "--checkpoint", deit_dir, option, "--out", str(tmp_path / "a")])
    assert rc == 2
    _one_error_line(capsys, needle)
    assert not (tmp_path / "a").exists()


def test_an_allocation_that_cannot_succeed_is_one_line(tmp_path, capsys, deit_dir):
    """``compress --latency-batch 10**12`` (256 TB of example images) was a traceback from torch's
    CPU allocator; running out of memory for the sizes asked for is the user's to fix. (``--quiet``:
    the per-block progress lines also go to stderr, before the latency measurement fails.)"""
    assert main(["compress", "--checkpoint", deit_dir, "--qk-rank", "4", "--latency-batch", str(10 ** 12),
                          "--quiet", "--out", str(tmp_path / "c")]) == 2
    _one_error_line(capsys, "out of memory", "smaller batch")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("argv, needle", [(["--eval-batches", "0"], "eval_batches must be >= 1"),
                                          (["--eval-batches", "-2"], "eval_batches must be >= 1"),
                                          (["--block-size", "-1"], "block_size must be >= 1 (0: the run's)")])
def test_eval_refuses_out_of_range_language_model_options(tmp_path, capsys, argv, needle):
    """On a language-model run, --eval-batches 0 printed 'loss 0.0000 (perplexity 1.000, 0 tokens)'
    and -2 / --block-size -1 were tracebacks; the options are now checked before the checkpoint is read."""
    assert main(["eval", "--checkpoint", str(tmp_path), *argv]) == 2
    _one_error_line(capsys, needle)


def test_layerwise_inputs_of_random_bytes_are_named_as_not_a_torch_file(tmp_path, capsys, deit_dir):
    """``--inputs FILE`` of random bytes was called a pickle 'which could run code' (torch's
    weights-only preamble, the file unnamed), as it was for checkpoints."""
    junk = tmp_path / "inputs.pt"
    junk.write_bytes(bytes(range(256)) * 4)
    rc = main(["analyze", "layerwise", "--checkpoint", deit_dir, f"--inputs={junk}", "--out", str(tmp_path / "a")])
    assert rc == 2
    line = _one_error_line(capsys, str(junk), "is not a valid torch checkpoint")
    assert "could run code" not in line


@pytest.mark.parametrize("words,needle", [
    (["--model-arg", "drop_rate=0.0"], "unknown option 'model_arg' for CompressConfig (did you mean 'model_args'?)"),
    (["--data", "digits"], "unknown option 'data' for CompressConfig"),
    (["model_args.bogus"], "unexpected argument 'model_args.bogus': use --key value or key=value"),
])
def test_compress_option_spellings_outside_the_train_style_are_one_usage_line(tmp_path, capsys, deit_dir,
                                                                              words, needle):
    """Constructor overrides are ``model_args.KEY=VALUE`` and the data set ``--dataset``, as in
    ``whiteformer train``; another spelling is a one-line usage error, exit code 2."""
    assert main(["compress", "--checkpoint", deit_dir, "--qk-rank", "4", *words, "--out", str(tmp_path / "c")]) == 2
    _one_error_line(capsys, needle)


def test_a_yaml_alias_bomb_is_refused_when_read(tmp_path, capsys):
    """A config whose aliases repeat each other ('billion laughs') stalled train: with 10**9 values in
    model_args the error message alone ran past a minute at 4.6 GB. Here 10**6 (fast either way): it used
    to be formatted into a multi-megabyte error line."""
    lines = ["model: deit_t_p16", "dataset: digits", "model_args:", '  x0: &x0 ["x","x","x","x","x","x","x","x","x","x"]']
    lines += [f"  x{i}: &x{i} [" + ",".join([f"*x{i - 1}"] * 10) + "]" for i in range(1, 6)]
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\n")
    assert main(["train", "-c", str(tmp_path / "bomb.yaml"), "--out", str(tmp_path / "r")]) == 2
    line = _one_error_line(capsys, "bomb.yaml", "expands to more than 100000 values")
    assert len(line) < 500 and not (tmp_path / "r").exists()


@pytest.mark.parametrize("config", [{"depth": 200000}, "array"])
def test_layerwise_of_a_hostile_config_json_is_one_line(tmp_path, capsys, deit_dir, config):
    """The size check refused depth=200000 before building (as eval does), but analyze layerwise let
    its ValueError through as a traceback; so was a config.json holding a JSON array."""
    import json
    import shutil

    d = tmp_path / "model"
    shutil.copytree(deit_dir, d)
    c = json.loads((d / "config.json").read_text())
    if config == "array":
        c = [1, 2]
    else:
        c["init_kwargs"].update(config)
    (d / "config.json").write_text(json.dumps(c))
    assert main(["analyze", "layerwise", "--checkpoint", str(d), "--out", str(tmp_path / "a")]) == 2
    _one_error_line(capsys, "cannot load", "more than 1024 blocks" if config != "array" else "config.json")
    assert not (tmp_path / "a").exists()


# ----------------------------------------------------------------------------- counts and data_args
@pytest.mark.parametrize("argv,needle", [
    (["--epochs", "1e23"], "epochs must be an integer below 2**63"),
    (["--epochs", str(10 ** 23)], "epochs must be an integer below 2**63"),
    (["--epochs", "inf"], "epochs must be a finite integer, got inf"),
    (["--epochs", "nan"], "epochs must be a finite integer, got nan"),
    (["--epochs", "10000000"], "epochs must be at most 1000000"),
    (["--steps", "1e13"], "steps must be at most 1000000000000"),
    (["--steps", "-inf"], "steps must be a finite integer"),
    (["--batch-size", "1e30"], "batch_size must be an integer below 2**63"),
])
def test_absurd_counts_are_refused(tmp_path, capsys, argv, needle):
    """--epochs 1e23 was accepted (a run of 10**23 epochs)."""
    assert main(["train", *TINY, "--out", str(tmp_path / "r"), *argv]) == 2
    _one_error_line(capsys, needle)
    assert not (tmp_path / "r").exists()


SUBSPACES_TINY = ["--dataset", "subspaces", "--model", "tost_t12_p16", "--steps", "1", "--batch-size", "16",
                  "model_args={patch_size: 2, embed_dim: 16, depth: 1, num_heads: 2}", "--no-progress",
                  "--no-tensorboard", "--no-report"]


@pytest.mark.parametrize("dataset,arg,needle", [
    ("subspaces", "num_train=inf", "num_train must be finite, got inf"),
    ("subspaces", "num_train=nan", "num_train must be finite"),
    ("subspaces", "num_train=1e12", "num_train must be an integer in [0, 1000000000]"),
    ("subspaces", "num_train=-5", "num_train must be an integer in [0, 1000000000]"),
    ("subspaces", "num_train=12.5", "num_train must be an integer, got 12.5"),
    ("subspaces", "seed=0.5", "seed must be an integer, got 0.5"),
    ("subspaces", "seed=abc", "seed must be an integer, got 'abc'"),
    ("subspaces", "seed=-1", "seed must be an integer in [0, 9223372036854775807]"),
    ("subspaces", "noise_std=inf", "noise_std must be finite"),
    ("subspaces", "layout=", "layout must be a non-empty string"),
    ("listops", "max_depth=[3]", "max_depth must be an integer, got [3]"),
    ("text", "tokenizer=", "tokenizer must be a non-empty string, got ''"),
    ("text", "pack=yes-please", "pack must be true or false"),
    ("text", "eod=", "eod must be a non-empty string"),
])
def test_data_args_of_the_wrong_kind_are_one_error_line(tmp_path, capsys, dataset, arg, needle):
    """num_train=inf, seed=0.5 / abc were tracebacks from inside torch; tokenizer= (empty) ended on a
    sentencepiece line (the empty path is the working directory, read as a tokenizer folder)."""
    argv = [*SUBSPACES_TINY[2:], "--dataset", dataset]
    assert main(["train", *argv, f"data_args.{arg}", "--out", str(tmp_path / "r")]) == 2
    line = _one_error_line(capsys, f"cannot build dataset {dataset!r}: {needle}")
    assert "Error:" not in line  # the message alone, not the exception's class
    assert not (tmp_path / "r").exists()


def test_a_mapping_option_given_without_its_value_names_the_forms(tmp_path, capsys):
    """`--model-args dim=64` said "model_args must be a mapping ..., got True"."""
    assert main(["train", "--model-args", "dim=64", "--out", str(tmp_path / "r")]) == 2
    line = _one_error_line(capsys, "--model-args takes a mapping", "model_args.dim=64")
    assert "True" not in line


def test_train_help_lists_every_registered_dataset(capsys):
    from whiteformer.app.data import list_datasets

    assert main(["train", "--help"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("--dataset "))
    assert all(name in line for name in list_datasets()) and "tokens" in line, line


def test_eval_of_a_run_s_weights_file_reads_the_run_s_settings_beside_it(tmp_path, capsys):
    """`eval --checkpoint RUN/final/model.safetensors` ignored train_config.json beside it (and asked
    for --model and --dataset)."""
    import json

    out = tmp_path / "r"
    assert main(["train", *SUBSPACES_TINY, "data_args={num_train: 32, num_test: 16}", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out / "final"), "--json"]) == 0
    folder = json.loads(capsys.readouterr().out)
    assert main(["eval", "--checkpoint", str(out / "final" / "model.safetensors"), "--json"]) == 0
    weights = json.loads(capsys.readouterr().out)
    assert weights["dataset"] == "subspaces" and weights["loss"] == folder["loss"] and weights["n"] == 16


def test_a_native_panic_is_one_error_line(tmp_path, capsys, monkeypatch):
    """pyo3's PanicException (tokenizers) derives from BaseException, which main's `except Exception`
    missed: a traceback."""
    tokenizers = pytest.importorskip("tokenizers")
    from test_tokenizer import backtracking_tokenizer

    backend = tokenizers.Tokenizer.from_file(str(backtracking_tokenizer(tmp_path)))
    with pytest.raises(BaseException) as info:  # a real panic of the library
        backend.encode("a" * 5000 + "b")
    assert not isinstance(info.value, Exception)
    import whiteformer.app.cli as cli

    def panics(args):
        raise info.value

    monkeypatch.setattr(cli.COMMANDS["list-models"], "run", panics)
    assert main(["list-models"]) == 2
    _one_error_line(capsys, "a native library failed", "retry-limit", "backtracks")


def test_ctrl_c_during_start_up_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C while the command was still importing the training package printed a KeyboardInterrupt
    traceback. A real SIGINT at several moments of a train command's start-up (the first while it
    imports its modules), in a process that has imported only the command line."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import contextlib, io, os, signal, threading
        from whiteformer.app.cli import main
        for i, delay in enumerate([0.01, 0.1, 0.4]):
            timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
            err = io.StringIO()
            timer.start()
            try:
                with contextlib.redirect_stderr(err):
                    rc = main(["train", "--dataset", "subspaces", "--steps", "100000", "--batch-size", "8",
                               "model_args={{patch_size: 2, embed_dim: 16, depth: 1, num_heads: 2}}",
                               "--no-progress", "--no-tensorboard", "--no-report", "--num-threads", "1",
                               "--out", {str(tmp_path)!r} + f"/r{{i}}"])
            except BaseException as e:
                rc = "raised " + type(e).__name__
            timer.join()
            lines = [ln for ln in err.getvalue().splitlines() if ln.strip() and not ln.startswith("run ")]
            print(repr((delay, rc, "Traceback" in err.getvalue(), lines[-1:])))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    results = [eval(line) for line in res.stdout.splitlines() if line.startswith("(")]
    assert len(results) == 3, res.stdout
    for delay, rc, traceback, last in results:
        assert rc == 130 and not traceback and last and "interrupted" in last[0], (delay, rc, last)
