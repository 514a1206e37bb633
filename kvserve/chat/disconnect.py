"""Client disconnects, for code that waits in a thread. Django cancels only the coroutine of a request whose
client went away; a sync view blocked in its thread never hears of it. `watch_disconnect` wraps the ASGI
application and sets a threading.Event in the request's scope when `http.disconnect` arrives, which
`client_gone(request)` hands to the waiting code."""
import threading

SCOPE_KEY = "kvserve.client_gone"


def watch_disconnect(app):
    async def application(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        gone = threading.Event()

        async def watched_receive():
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            return message

        return await app({**scope, SCOPE_KEY: gone}, watched_receive, send)

    return application


def client_gone(request) -> threading.Event | None:
    """The request's disconnect event (None outside ASGI, e.g. under the test client)."""
    scope = getattr(request, "scope", None) or {}
    return scope.get(SCOPE_KEY)
