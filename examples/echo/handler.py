"""Echo: the response is the request body, with its content type.

An ``async`` handler runs on the worker's event loop (no thread hop), which suits a function
that does no blocking work; ``concurrency: 64`` lets one instance serve many requests at once.
"""

from trims.runtime.functions import Context, Request, Response


async def handler(request: Request, ctx: Context) -> Response:
    return Response(request.body, headers={"content-type": request.content_type})
