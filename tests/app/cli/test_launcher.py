"""The console command's entry point (``whiteformer_cli``, outside the package): ``--version``
without importing the library, and an interrupt while the library imports as one line."""
import subprocess
import sys
import textwrap

from whiteformer import __version__


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_version_imports_neither_torch_nor_the_library():
    res = _run("""
        import sys, whiteformer_cli
        rc = whiteformer_cli.main(["--version"])
        print(rc, sorted({m.split(".")[0] for m in sys.modules} & {"torch", "whiteformer", "numpy"}))
    """)
    assert res.returncode == 0, res.stderr
    version, last = res.stdout.splitlines()
    assert version == f"whiteformer {__version__}"
    assert last == "0 []"


def test_every_other_command_is_the_library_command_line(capsys):
    import whiteformer_cli

    assert whiteformer_cli.main(["list-models", "tost_t12_*"]) == 0
    assert "tost_t12_p16" in capsys.readouterr().out
    assert whiteformer_cli.main(["no-such-command"]) == 2 and "error" in capsys.readouterr().err


def test_an_interrupt_while_the_library_imports_is_one_line():
    """Ctrl-C before the command line is loaded (here: raised by the import of whiteformer.app.cli)
    gives the command's own interrupt line and exit 130, not a KeyboardInterrupt traceback."""
    res = _run("""
        import sys, whiteformer_cli

        class Interrupt:
            def find_spec(self, name, path=None, target=None):
                if name == "whiteformer.app.cli":
                    raise KeyboardInterrupt

        sys.meta_path.insert(0, Interrupt())
        sys.exit(whiteformer_cli.main(["train", "-c", "demo_digits"]))
    """)
    assert res.returncode == 130, res.stderr
    assert res.stderr.strip() == "whiteformer train: interrupted"
