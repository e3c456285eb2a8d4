"""Access patterns of the Triton kernels for the traffic model (:mod:`benchmarks.kernels.traffic`):
``PATTERNS[module][kernel][argument] = (mode, pattern, passes, flag)`` for every pointer argument
of every kernel of ``whiteformer.ops._kernels.triton.<module>`` (the meaning of each field: the
traffic model's docstring). A new kernel or pointer argument needs its entry here; the traffic
test fails naming it otherwise.
"""

SCALES = ("r", "all", 1, None)  # the per-(sequence, head) [1 / c, c, eps / c^2], read once per program

_TILES = {
    "chunk_energy": {"x_ptr": ("r", "tile", 1, None), "mask_ptr": ("r", "mask", 1, "has_mask"),
                     "part_ptr": ("w", "all", 1, None), "amax_ptr": ("w", "all", 1, None)},
}


_TSSA = {
    "_pi": {"x_ptr": ("r", "tile", 1, None), "mask_ptr": ("r", "mask", 1, "has_mask"), "scl_ptr": SCALES, "r_ptr": ("r", "all", 1, None),
            "temp_ptr": ("r", "all", 1, None), "pi_ptr": ("w", "token", 1, None),
            "t_part_ptr": ("w", "all", 1, None), "m_part_ptr": ("w", "all", 1, None)},
    "_out": {"x_ptr": ("r", "tile", 1, None), "mask_ptr": ("r", "mask", 1, "has_mask"), "scl_ptr": SCALES,
             "pi_ptr": ("r", "token", 1, None), "t_ptr": ("r", "all", 1, None), "m_ptr": ("r", "all", 1, None),
             "out_ptr": ("w", "tile", 1, None)},
    "_bwd_q": {"x_ptr": ("r", "tile", 1, None), "mask_ptr": ("r", "mask", 1, "has_mask"), "scl_ptr": SCALES,
               "pi_ptr": ("r", "token", 1, None), "go_ptr": ("r", "tile", 1, None),
               "q_part_ptr": ("w", "all", 1, None)},
    "_bwd_lambda": {"x_ptr": ("r", "tile", 1, None), "mask_ptr": ("r", "mask", 1, "has_mask"), "scl_ptr": SCALES,
                    "pi_ptr": ("r", "token", 1, None), "go_ptr": ("r", "tile", 1, None),
                    "gpi_ptr": ("r", "token", 1, "has_gpi"), "gain_ptr": ("r", "all", 1, None),
                    "cd_ptr": ("r", "all", 1, None), "k_ptr": ("r", "all", 1, None), "r_ptr": ("r", "all", 1, None),
                    "temp_ptr": ("r", "all", 1, None), "lam_ptr": ("w", "token", 1, None),
                    "dtemp_part_ptr": ("w", "all", 1, None), "ds_part_ptr": ("w", "all", 1, None)},
    "_bwd_dw": {"x_ptr": ("r", "tile", 1, None), "mask_ptr": ("r", "mask", 1, "has_mask"), "scl_ptr": SCALES,
                "pi_ptr": ("r", "token", 1, None), "go_ptr": ("r", "tile", 1, None), "gain_ptr": ("r", "all", 1, None),
                "cd_ptr": ("r", "all", 1, None), "r_ptr": ("r", "all", 1, None), "ds_ptr": ("r", "all", 1, None),
                "lam_ptr": ("r", "token", 1, None), "dw_ptr": ("w", "tile", 1, None)},
}


_CAUSAL_TSSA = {
    "_pi": {"x_ptr": ("r", "tile", 1, None), "mask_ptr": ("r", "mask", 1, "has_mask"), "scl_ptr": SCALES,
            "e0_ptr": ("r", "all", 1, None), "lb_ptr": ("r", "token", 1, "has_lb"), "temp_ptr": ("r", "all", 1, None),
            "pi_ptr": ("w", "token", 1, None), "q_part_ptr": ("w", "all", 1, None),
            "m_part_ptr": ("w", "all", 1, None)},
    "_out": {"x_ptr": ("r", "tile", 1, None), "mask_ptr": ("r", "mask", 1, "has_mask"), "scl_ptr": SCALES,
             "pi_ptr": ("r", "token", 1, None), "q0_ptr": ("r", "all", 1, None), "m0_ptr": ("r", "all", 1, None),
             "out_ptr": ("w", "tile", 1, None)},
    "_bwd_chunk": {"x_ptr": ("r", "tile", 1, None), "mask_ptr": ("r", "mask", 1, "has_mask"), "scl_ptr": SCALES,
                   "pi_ptr": ("r", "token", 1, None), "go_ptr": ("r", "tile", 1, None),
                   "q0_ptr": ("r", "all", 1, None), "m0_ptr": ("r", "all", 1, None),
                   "dq_part_ptr": ("w", "all", 1, None), "dm_part_ptr": ("w", "all", 1, None)},
    "_bwd_lambda": {"x_ptr": ("r", "tile", 1, None), "mask_ptr": ("r", "mask", 1, "has_mask"), "scl_ptr": SCALES,
                    "pi_ptr": ("r", "token", 1, None), "go_ptr": ("r", "tile", 1, None),
                    "gpi_ptr": ("r", "token", 1, "has_gpi"), "lb_ptr": ("r", "token", 1, "has_lb"),
                    "temp_ptr": ("r", "all", 1, None), "e0_ptr": ("r", "all", 1, None), "q0_ptr": ("r", "all", 1, None),
                    "m0_ptr": ("r", "all", 1, None), "u_ptr": ("r", "all", 1, None), "v_ptr": ("r", "all", 1, None),
                    "lam_ptr": ("w", "token", 1, None), "dtemp_part_ptr": ("w", "all", 1, None),
                    "de_part_ptr": ("w", "all", 1, None)},
    # two walks over the chunk: w and lambda are read twice (the dE total first, see _bwd_dw)
    "_bwd_dw": {"x_ptr": ("r", "tile", 2, None), "mask_ptr": ("r", "mask", 2, "has_mask"), "scl_ptr": SCALES,
                "pi_ptr": ("r", "token", 1, None), "go_ptr": ("r", "tile", 1, None), "lam_ptr": ("r", "token", 2, None),
                "e0_ptr": ("r", "all", 2, None), "q0_ptr": ("r", "all", 1, None), "m0_ptr": ("r", "all", 1, None),
                "u_ptr": ("r", "all", 1, None), "w_ptr": ("r", "all", 1, None), "dw_ptr": ("w", "tile", 1, None)},
}


_CAUSAL_TSSA_STEP = {  # one program per sequence: every tensor once
    "_step_fwd": {**{k: ("r", "all", 1, None) for k in ("x_ptr", "e0_ptr", "m0_ptr", "q0_ptr", "temp_ptr",
                                                        "scl_ptr")},
                  "lb_ptr": ("r", "all", 1, "has_lb"),
                  **{k: ("w", "all", 1, None) for k in ("out_ptr", "pi_ptr", "e_ptr", "m_ptr", "q_ptr")}},
    "_step_bwd": {**{k: ("r", "all", 1, None) for k in ("go_ptr", "gpi_ptr", "ge_ptr", "gm_ptr", "gq_ptr", "x_ptr",
                                                        "e0_ptr", "m0_ptr", "q0_ptr", "temp_ptr", "scl_ptr")},
                  "lb_ptr": ("r", "all", 1, "has_lb"),
                  **{k: ("w", "all", 1, None)
                     for k in ("dx_ptr", "de_ptr", "dm_ptr", "dq_ptr", "dtemp_ptr", "dlb_ptr")}},
}


PATTERNS = {"_tiles": _TILES, "tssa": _TSSA, "causal_tssa": _CAUSAL_TSSA, "causal_tssa_step": _CAUSAL_TSSA_STEP}
