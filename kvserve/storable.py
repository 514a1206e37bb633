"""Text PostgreSQL cannot store (U+0000 in text or jsonb, lone UTF-16 surrogates anywhere): found at the API
boundary, in every string of a JSON body (keys too) and in the URL's path and query, and refused with a 400
that names where it is, before any of it reaches a model, a queue or the database."""
from django.http import JsonResponse

from kvserve.errors import ApiError, error_body


def text_refusal(text: str) -> tuple[str, str] | None:
    """(code, why) when `text` cannot be stored, else None."""
    if "\x00" in text:
        return "null_character", "contains U+0000 (NUL), which cannot be stored"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return "surrogates", f"contains an unpaired UTF-16 surrogate (U+{ord(text[exc.start]):04X})"
    return None


def unstorable_find(value, path: tuple = ()) -> tuple[str, str, str] | None:
    """(param, code, why) of the first string in a parsed JSON value that cannot be stored, else None."""
    if isinstance(value, str):
        refusal = text_refusal(value)
        return (".".join(path) or None, *refusal) if refusal else None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((str(i), item) for i, item in enumerate(value))
    else:
        return None
    for key, item in items:
        refusal = text_refusal(key)
        if refusal:
            return (".".join((*path, key.encode("unicode_escape").decode())), *refusal)
        found = unstorable_find(item, (*path, key))
        if found:
            return found
    return None


def storable_check(value) -> None:
    """ApiError 400 at the first string of `value` that cannot be stored."""
    found = unstorable_find(value)
    if found:
        param, code, why = found
        raise ApiError(f"'{param or 'body'}' {why}; remove it.", param=param, code=code)


class StorableUrlMiddleware:
    """400 in the API's error format for a URL whose path or query holds text that cannot be stored: every
    path id (a request id, an admin object id) and query value, of every view, API or not."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        found = unstorable_find(request.path_info, ("path",)) or unstorable_find(
            [[k, *request.GET.getlist(k)] for k in request.GET], ("query",))
        if found:
            param, code, why = found
            return JsonResponse(error_body(f"The URL's {param.split('.')[0]} {why}; remove it.", param=param,
                                           code=code), status=400)
        return self.get_response(request)
