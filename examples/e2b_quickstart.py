# E2B's own quick start (the `e2b` Python SDK's README), unchanged: it runs on
# agent-sandbox's tiers when the SDK is pointed at `agent-sandbox serve`:
#
#   agent-sandbox serve &      # prints where it wrote its token (64 hex digits)
#   export E2B_API_URL=http://127.0.0.1:7878 E2B_SANDBOX_URL=http://127.0.0.1:7878
#   export E2B_API_KEY=e2b_$(cat "$XDG_RUNTIME_DIR/agent-sandbox/token")
#   pip install e2b && python examples/e2b_quickstart.py
#
# See docs/e2b.md.
from e2b import Sandbox

with Sandbox.create() as sandbox:
    result = sandbox.commands.run('echo "Hello from E2B!"')
    print(result.stdout)  # Hello from E2B!
