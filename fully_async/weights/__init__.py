"""Weight transports: how one version of the trainer's weights reaches every engine server (ParamSync drives them)."""

from fully_async.weights.base import TRANSPORTS, WeightTransport
from fully_async.weights.factory import build_transport

__all__ = ["TRANSPORTS", "WeightTransport", "build_transport"]
