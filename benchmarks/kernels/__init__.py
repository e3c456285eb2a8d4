"""Test and benchmark tooling of the Triton kernels, outside the installed package: recording the
launches the ops make without running them (:mod:`.launches`), compiling them for sm_80/sm_90 and
reading their registers and stack (:mod:`.compile_check`), and the memory-traffic model
(:mod:`.traffic`, with each kernel's access patterns in :mod:`.access_patterns`)."""
