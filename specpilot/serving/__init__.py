"""Serving: requests, the continuous-batching engine and its slot state."""

from specpilot.serving.engine import Engine  # noqa: F401
from specpilot.serving.engine_checks import check_plan  # noqa: F401
from specpilot.serving.handles import Handle  # noqa: F401
from specpilot.serving.request import Request, RequestError, check_request  # noqa: F401
