# E2B's code interpreter quick start (the `e2b-code-interpreter` SDK's README), unchanged
# but for the last lines: it runs on agent-sandbox's tiers when the SDK is pointed at
# `agent-sandbox serve`, set up as for e2b_quickstart.py:
#
#   pip install e2b-code-interpreter && python examples/e2b_code_interpreter.py
#
# See docs/e2b.md (the code interpreter row) and docs/interpreter.md.
from e2b_code_interpreter import Sandbox

with Sandbox.create() as sandbox:
    sandbox.run_code("x = 1")
    execution = sandbox.run_code("x+=1; x")
    print(execution.text)  # outputs 2

    # Contexts keep their own state; errors come back structured.
    ctx = sandbox.create_code_context()
    failed = sandbox.run_code("x", context=ctx)
    print(failed.error.name)  # NameError
