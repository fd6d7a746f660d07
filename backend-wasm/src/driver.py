# The wasm tier's Python session driver, run once as the first turn of every interpreter
# after the shared cell code (sandbox_core::interpreter::PYTHON_CELLS; see python.rs). It
# reports each cell's rich outputs to the host through the door (`_host.call`): the
# displayhook, the excepthook, a `display` builtin, and that `matplotlib.pyplot` was
# imported (the host then calls `_agent_sandbox.flush()` after a cell that made a figure,
# which displays and closes the figures left open). Guest code can call the door itself:
# the host checks every frame and counts it against the call's output cap.
def __agent_sandbox_setup():
    import builtins, json, os, sys, warnings, _host

    door = _host.call
    PREFIX = {
        "result": b"\0agent-sandbox/result\0",
        "display": b"\0agent-sandbox/display\0",
        "error": b"\0agent-sandbox/error\0",
    }
    PYPLOT = b"\0agent-sandbox/pyplot\0"
    FIGURE = b"\0agent-sandbox/figure\0"
    WATCH = b"\0agent-sandbox/watch\0"

    def send(kind, frame):
        """Sends a frame; False when the host took no more (the cap was reached)."""
        try:
            return b"full" not in door(PREFIX[kind] + json.dumps(frame).encode())
        except Exception:
            return True

    cells = __agent_sandbox_cells(send)

    prev_display = sys.displayhook

    def displayhook(value, _prev=prev_display):
        if value is not None:
            cells.result(value)
        _prev(value)

    prev_except = sys.excepthook

    def excepthook(kind, value, tb, _prev=prev_except):
        cells.error(kind, value, tb)
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
        if "matplotlib.pyplot" in sys.modules:
            try:
                watch_figures()
            except Exception:
                pass
        cells.flush()

    sys.displayhook = displayhook
    sys.excepthook = excepthook
    builtins.display = cells.display
    sys.meta_path.insert(0, PyplotWatch)
    # Figures are shown after the cell; Agg's `show()` has nothing to add.
    warnings.filterwarnings("ignore", message=".*(non-GUI backend|non-interactive).*")
    module = type(sys)("_agent_sandbox")
    module.flush = flush
    module.display = cells.display
    sys.modules["_agent_sandbox"] = module
    try:
        os.chdir("/workspace")
    except OSError:
        pass


__agent_sandbox_setup()
del __agent_sandbox_setup, __agent_sandbox_cells
