# The wasm tier's Python session driver, run once as the first turn of every interpreter
# (backend-wasm/src/python.rs). It reports each cell's rich outputs to the host through the
# door (`_host.call`), in Jupyter's display model: the last expression's value (the
# displayhook), every `display(obj)`, the exception that ended a cell (the excepthook), and
# that `matplotlib.pyplot` was imported (the host then calls `_agent_sandbox.flush()` after
# each cell, which displays and closes the figures left open). Guest code can call the door
# itself: the host checks every frame and counts it against the call's output cap.
def __agent_sandbox_setup():
    import builtins, json, os, sys, warnings, _host
    from binascii import b2a_base64

    door = _host.call
    RESULT = b"\0agent-sandbox/result\0"
    DISPLAY = b"\0agent-sandbox/display\0"
    ERROR = b"\0agent-sandbox/error\0"
    PYPLOT = b"\0agent-sandbox/pyplot\0"
    FIGURE = b"\0agent-sandbox/figure\0"
    WATCH = b"\0agent-sandbox/watch\0"
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

    def send(prefix, frame):
        """Sends a frame; False when the host took no more (the cap was reached)."""
        try:
            return b"full" not in door(prefix + json.dumps(frame).encode())
        except Exception:
            return True

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
            send(DISPLAY, {"data": bundle(obj)})

    prev_display = sys.displayhook

    def displayhook(value, _prev=prev_display):
        if value is not None:
            send(RESULT, {"value": value_json(value), "data": bundle(value)})
        _prev(value)

    prev_except = sys.excepthook

    def excepthook(kind, value, tb, _prev=prev_except):
        try:
            import traceback

            lines = "".join(traceback.format_exception(kind, value, tb)).splitlines()
            # The full traceback is on stderr; the structured one is bounded.
            lines = [line[:MAX_LINE] for line in lines[-MAX_LINES:]]
            text = str(value)
            if len(text) > MAX_LINE:
                text = text[:MAX_LINE] + "..."
            send(ERROR, {"name": kind.__name__, "value": text, "traceback": lines})
        except Exception:
            pass
        _prev(kind, value, tb)

    class PyplotWatch:
        """Tells the host once that pyplot is being imported (then returns nothing)."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "matplotlib.pyplot":
                try:
                    door(PYPLOT)
                except Exception:
                    pass
            return None

    def watch_figures():
        """Once: tells the host whenever a figure is made, so that a cell that makes none
        needs no flush (as Jupyter's inline backend tracks drawing)."""
        helpers = sys.modules.get("matplotlib._pylab_helpers")
        gcf = getattr(helpers, "Gcf", None)
        if gcf is None or getattr(gcf, "_agent_sandbox_watch", False):
            return
        made = gcf._set_new_active_manager

        def set_new_active_manager(cls, manager, _made=made):
            try:
                door(FIGURE)
            except Exception:
                pass
            return _made(manager)

        gcf._set_new_active_manager = classmethod(set_new_active_manager)
        gcf._agent_sandbox_watch = True
        door(WATCH)

    def flush():
        """Displays and closes every open matplotlib figure (after a cell that drew)."""
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        try:
            watch_figures()
        except Exception:
            pass
        room = True
        for num in plt.get_fignums():
            try:
                if room:
                    room = send(DISPLAY, {"data": bundle(plt.figure(num))})
            except Exception as e:
                sys.stderr.write("figure %s could not be rendered: %s\n" % (num, e))
            finally:
                plt.close(num)

    sys.displayhook = displayhook
    sys.excepthook = excepthook
    builtins.display = display
    sys.meta_path.insert(0, PyplotWatch)
    # Figures are shown after the cell; Agg's `show()` has nothing to add.
    warnings.filterwarnings("ignore", message=".*(non-GUI backend|non-interactive).*")
    module = type(sys)("_agent_sandbox")
    module.flush = flush
    module.display = display
    sys.modules["_agent_sandbox"] = module
    try:
        os.chdir("/workspace")
    except OSError:
        pass


__agent_sandbox_setup()
del __agent_sandbox_setup
