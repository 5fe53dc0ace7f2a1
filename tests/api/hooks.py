"""Schemathesis hooks for scripts/test-api.sh (loaded via SCHEMATHESIS_HOOKS).

1. `server_error_only_for_exec_timeout` replaces schemathesis's
   `not_a_server_error`: the API documents exactly one 5xx that is not a
   fault, an exec or cell that ran into its timeout (500 whose `error`
   contains "timeout", as the PandaStack clients expect), plus 503 for a
   create (or fork) refused for capacity (it carries Retry-After). Every other 5xx,
   and a 500 on exec that is not a timeout, fails the run.
2. `resource_available_unless_its_end_was_asked_for` replaces schemathesis's
   `ensure_resource_availability`, which takes a 404 for a resource created
   earlier in a scenario as a fault unless a DELETE removed it. A sandbox
   also ends because a request asked for it in another way (an exec with
   `delete_after`) or its lifecycle did (the idle TTL it was created with,
   the maximum lifetime); its 404 then names that `end_reason`, and those
   ends are not faults. Any other 404 (no reason, or a sandbox that stopped
   on its own) still fails the run.
"""

import json

import schemathesis
from schemathesis.specs.openapi.checks import ensure_resource_availability

TIMEOUT_OPERATIONS = {"execCommand", "runCell"}
CREATING_OPERATIONS = {"createSandbox", "forkSandbox", "forkTree"}


@schemathesis.check
def server_error_only_for_exec_timeout(ctx, response, case):
    """No 5xx but a documented exec/cell timeout or a create refused for capacity."""
    status = response.status_code
    if status < 500:
        return None
    op = case.operation.definition.raw.get("operationId")
    try:
        error = json.loads(response.content).get("error", "")
    except Exception:  # not JSON: a failure either way
        error = ""
    if status == 500 and op in TIMEOUT_OPERATIONS and "timeout" in error:
        return None
    # A fork makes sandboxes too, under the same capacity.
    if status == 503 and op in CREATING_OPERATIONS and response.headers.get("retry-after") and "no capacity" in error:
        return None
    raise AssertionError(f"{status} from {op}: {error or response.content[:300]!r}")


# A sandbox's ends that a request or its lifecycle asked for, as its 404
# names them (`end_reason`; crates/server/src/state.rs and http/exec.rs).
ENDS_ASKED_FOR = {
    "deleted by the API",
    "deleted after its exec (delete_after)",
    "idle ttl expired",
    "maximum lifetime reached",
}


@schemathesis.check
def resource_available_unless_its_end_was_asked_for(ctx, response, case):
    """ensure_resource_availability, but for a sandbox whose end was asked for."""
    try:
        return ensure_resource_availability(ctx, response, case)
    except AssertionError:
        try:
            reason = json.loads(response.content).get("end_reason")
        except Exception:  # not JSON: the failure stands
            reason = None
        if reason in ENDS_ASKED_FOR:
            return None
        raise
