"""A JSON body parser for the public API: refuses bodies over KVSERVE_MAX_BODY_BYTES with 413, and any body
that is not strict UTF-8 JSON, or holds a string PostgreSQL cannot store (kvserve/storable.py), with a 400
that says why (never a 500, whatever the bytes). Under uvicorn the ASGI middleware (kvserve/bodylimit.py) has
already refused an oversized body; this is the same rule for WSGI and the test client. Not a JSONParser subclass: DRF reads such a parser's body in full first."""
import json

from django.conf import settings
from rest_framework import parsers
from rest_framework.exceptions import ParseError

from kvserve.errors import request_too_large
from kvserve.storable import storable_check


def _no_constants(name):
    raise ValueError(f"{name} is not valid JSON")


class LimitedJSONParser(parsers.BaseParser):
    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.KVSERVE_MAX_BODY_BYTES
        request = (parser_context or {}).get("request")
        try:
            declared = int(request.META.get("CONTENT_LENGTH") or 0) if request is not None else 0
        except ValueError:
            declared = 0
        if declared > limit:
            raise request_too_large(limit)
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise request_too_large(limit)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ParseError(f"Request body is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}).")
        try:
            data = json.loads(text, parse_constant=_no_constants)
        except ValueError as exc:
            raise ParseError(f"Request body is not valid JSON: {exc}")
        except RecursionError:
            raise ParseError("Request body is not valid JSON: nested too deeply.")
        storable_check(data)  # every string, whichever field it is in or whether any field reads it
        return data
