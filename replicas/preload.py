"""What every worker process of a Ray cluster prefixgate starts imports first.

`prefixgate serve --replicas N` starts Ray with this module in `preload_python_modules`, so
each worker imports it before it takes an actor. Only workers started for our own actors
(they carry `PRELOAD_ENV_VAR` in their runtime env: the replicas, the ingress and the spare
`replicas.spare_worker` keeps) go on to import the package, torch, the engine and the gateway
(~2 s here), ahead of need; Ray's own controller and proxy stay as light as Ray made them
(importing torch there would cost each ~140 MB for nothing).
"""

import os

from replicas.spare_worker import (  # the standard library only, at import
    PRELOAD_ENV_VALUE,
    PRELOAD_ENV_VAR,
)

if os.environ.get(PRELOAD_ENV_VAR) == PRELOAD_ENV_VALUE:
    import replicas.app  # noqa: F401
