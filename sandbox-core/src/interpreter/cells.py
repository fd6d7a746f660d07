# What every tier's Python driver shares (sandbox_core::interpreter::PYTHON_CELLS): a
# cell's rich outputs in Jupyter's display model. `__agent_sandbox_cells(send)` returns the
# pieces a driver wires up; `send(kind, frame)` carries one frame to the host ("result",
# "display" or "error") and returns False once the host takes no more (the output cap).
# Guest code can send frames itself: the host checks every one (sandbox_core::cell).
def __agent_sandbox_cells(send):
    import json, sys
    from binascii import b2a_base64

    REPRS = (
        ("text/html", "_repr_html_"),
        ("text/markdown", "_repr_markdown_"),
        ("image/svg+xml", "_repr_svg_"),
        ("image/png", "_repr_png_"),
        ("image/jpeg", "_repr_jpeg_"),
        ("text/latex", "_repr_latex_"),
        ("application/json", "_repr_json_"),
    )
    PLAIN = (int, float, complex, str, bool, bytes, list, tuple, dict, set, type(None))
    MAX_VALUE = 1 << 20
    MAX_LINES, MAX_LINE = 200, 4096

    def b64(data):
        return b2a_base64(data, newline=False).decode("ascii")

    def figure_png(fig):
        import io

        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        return b64(buf.getvalue())

    def bundle(obj):
        data = {}
        kind = type(obj)
        if kind not in PLAIN and not isinstance(obj, type):
            if kind.__module__.startswith("matplotlib.") and hasattr(obj, "savefig"):
                try:
                    data["image/png"] = figure_png(obj)
                except Exception:
                    pass
            for mime, name in REPRS:
                try:
                    f = getattr(obj, name, None)
                    v = f() if callable(f) else None
                    if isinstance(v, tuple) and v:
                        v = v[0]
                    if v is None:
                        continue
                    if isinstance(v, (bytes, bytearray)):
                        v = b64(v)
                    elif mime == "application/json":
                        json.dumps(v)
                    elif not isinstance(v, str):
                        continue
                    data[mime] = v
                except Exception:
                    continue
        try:
            data["text/plain"] = repr(obj)
        except Exception as e:
            data["text/plain"] = "<%s object (repr failed: %s)>" % (kind.__name__, e)
        return data

    def value_json(value):
        try:
            text = json.dumps(value, allow_nan=False)
        except Exception:
            try:
                text = json.dumps(repr(value))
            except Exception:
                return None
        return text if len(text) <= MAX_VALUE else None

    def display(*objs, **_options):
        """Shows each object as the cell's output (Jupyter's `display`)."""
        for obj in objs:
            send("display", {"data": bundle(obj)})

    def result(value):
        """Reports the value of the cell's last expression."""
        send("result", {"value": value_json(value), "data": bundle(value)})

    def error(kind, value, tb):
        """Reports the exception that ended the cell (bounded: the full traceback is on
        stderr)."""
        try:
            import traceback

            lines = "".join(traceback.format_exception(kind, value, tb)).splitlines()
            lines = [line[:MAX_LINE] for line in lines[-MAX_LINES:]]
            text = str(value)
            if len(text) > MAX_LINE:
                text = text[:MAX_LINE] + "..."
            send("error", {"name": kind.__name__, "value": text, "traceback": lines})
        except Exception:
            pass

    def flush():
        """Displays and closes every open matplotlib figure (after a cell)."""
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        room = True
        for num in plt.get_fignums():
            try:
                if room:
                    room = send("display", {"data": bundle(plt.figure(num))})
            except Exception as e:
                sys.stderr.write("figure %s could not be rendered: %s\n" % (num, e))
            finally:
                plt.close(num)

    class Cells:
        pass

    cells = Cells()
    cells.display, cells.result, cells.error, cells.flush = display, result, error, flush
    return cells
