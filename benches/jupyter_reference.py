"""The reference for the code-interpreter rows of benches/wasm.rs: a Jupyter kernel on the
host (ipykernel, driven by jupyter_client, as the peers run one inside their sandboxes),
the same two cells timed from the request to the kernel's idle status after the cell.
Prints one line per cell: `jupyter <name>: <median> ms (<n> runs)`."""
import statistics
import sys
import time

from jupyter_client.manager import start_new_kernel

CELLS = {
    "x + 1": "x + 1",
    "chart": "plt.plot(range(100), [i * i for i in range(100)])",
}


def run(kc, code):
    seen = []
    kc.execute_interactive(code, timeout=120, output_hook=lambda m: seen.append(m["msg_type"]))
    return seen


def main(n):
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        run(kc, "x = 1\nimport matplotlib.pyplot as plt\nplt.plot([1])")
        for name, code in CELLS.items():
            kinds = run(kc, code)
            want = "execute_result" if name == "x + 1" else "display_data"
            assert want in kinds, (name, kinds)
            times = []
            for _ in range(n):
                t = time.perf_counter()
                run(kc, code)
                times.append(time.perf_counter() - t)
            print("jupyter %s: %.3f ms (%d runs)" % (name, statistics.median(times) * 1e3, n))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)
