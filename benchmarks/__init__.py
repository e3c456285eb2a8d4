"""whiteformer benchmark suite (repository root, not part of the installed package).

``python -m benchmarks.run [attention|generation|compression|fused|all] [--quick]``; see
``docs/benchmarks.md``. Modules: :mod:`.common` (timing, memory, machine info, child processes),
:mod:`.attention_scaling`, :mod:`.generation`, :mod:`.compressed_attention`, :mod:`.run`.
"""
