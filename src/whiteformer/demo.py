"""``make demo`` placeholder until the training issue lands: forward/timing demo of the layers."""
import time

import torch

from whiteformer.attention import build, list_attention


def main() -> None:
    torch.manual_seed(0)
    B, N, C, H = 2, 1024, 192, 4
    x = torch.randn(B, N, C)
    print(f"whiteformer layers on x of shape {(B, N, C)} ({torch.get_num_threads()} threads)")
    for name in list_attention():
        layer = build(name, C, num_heads=H).eval()
        with torch.no_grad():
            layer(x)
            t0 = time.perf_counter()
            y = layer(x)
            dt = time.perf_counter() - t0
        print(f"  {name:12s} out {tuple(y.shape)}  {dt * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
