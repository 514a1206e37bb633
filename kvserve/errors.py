"""Every API error rendered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""
import logging

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler, set_rollback

from kvserve.logs import unavailable_log

log = logging.getLogger(__name__)


class ApiError(exceptions.APIException):
    """Raise from services/APIs for a precise OpenAI-style error, e.g. context_length_exceeded."""

    def __init__(self, message, *, status_code=400, type="invalid_request_error", param=None, code=None):
        super().__init__(detail=message, code=code)
        self.status_code = status_code
        self.error_type, self.param, self.error_code = type, param, code


def error_body(message, *, type="invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": str(message), "type": type, "param": param, "code": code}}


def api_error_body(exc: ApiError) -> dict:
    return error_body(exc.detail, type=exc.error_type, param=exc.param, code=exc.error_code)


def request_too_large(limit: int) -> ApiError:
    return ApiError(f"Request body exceeds the limit of {limit} bytes (KVSERVE_MAX_BODY_BYTES).", status_code=413,
                    code="request_too_large")


def too_many_requests(message: str, *, code: str, retry_after_s: int) -> ApiError:
    """429 rate_limit_error with a Retry-After header (DRF sets it from `wait`)."""
    exc = ApiError(message, status_code=429, type="rate_limit_error", code=code)
    exc.wait = max(1, int(retry_after_s))
    return exc


_TYPES = {401: "invalid_request_error", 403: "permission_error", 404: "invalid_request_error",
          429: "rate_limit_error"}


def _first_validation_error(detail, path=()):
    """(param, message, code) of the first leaf in a DRF ValidationError detail."""
    if isinstance(detail, dict):
        for key, value in detail.items():
            if value:  # a list serializer reports valid items as {}: skip to the first with errors
                param = path if key == "non_field_errors" else (*path, str(key))
                return _first_validation_error(value, param)
    if isinstance(detail, list) and detail:
        for index, item in enumerate(detail):
            if isinstance(item, dict) and item:
                return _first_validation_error(item, (*path, str(index)))
            if isinstance(item, list) and item:
                return _first_validation_error(item, path)
            if not isinstance(item, (dict, list)):
                return ".".join(path) or None, str(item), getattr(item, "code", None)
    return ".".join(path) or None, str(detail), getattr(detail, "code", None)


def _body_for(exc: exceptions.APIException) -> dict:
    if isinstance(exc, ApiError):
        return api_error_body(exc)
    if isinstance(exc, exceptions.ValidationError):
        param, message, code = _first_validation_error(exc.detail)
        return error_body(message, param=param, code=code)
    if isinstance(exc, exceptions.NotAuthenticated):
        return error_body(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
            code="missing_api_key",
        )
    if isinstance(exc, exceptions.AuthenticationFailed):
        return error_body(exc.detail, code="invalid_api_key")
    code = exc.get_codes() if isinstance(exc.get_codes(), str) else None
    return error_body(exc.detail, type=_TYPES.get(exc.status_code, "invalid_request_error"), code=code)


def openai_exception_handler(exc, context):
    """DRF EXCEPTION_HANDLER: DRF's own status/headers, OpenAI's body; unexpected errors become 500s."""
    if isinstance(exc, RequestDataTooBig):  # Django's own cap (DATA_UPLOAD_MAX_MEMORY_SIZE): the same 413
        exc = request_too_large(settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
    response = exception_handler(exc, context)
    if response is not None:
        response.data = _body_for(exc)
        if isinstance(exc, ApiError) and exc.error_code == "no_workers":
            unavailable_log(context["request"], response)  # expected while a stack starts: a warning
        return response
    log.exception("unhandled error in %s", context.get("view").__class__.__name__)
    set_rollback()
    return Response(
        error_body("The server had an error while processing your request.", type="server_error"),
        status=status.HTTP_500_INTERNAL_SERVER_ERROR,
    )


def json_not_found(request, exception=None):
    """handler404: unknown URLs answer in the same format."""
    return JsonResponse(error_body(f"Unknown URL: {request.path}", code="not_found"), status=404)


def json_server_error(request):
    """handler500 for non-DRF views."""
    return JsonResponse(
        error_body("The server had an error while processing your request.", type="server_error"),
        status=500,
    )
