"""Project-level HTTP endpoints: /healthz."""
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from kvserve.logs import unavailable_log
from kvserve.selectors import health_get


class HealthzApi(APIView):
    """Anonymous: 200 while a live prefill and a live decode worker can serve, 503 otherwise, with the
    effective context limit (prompt + max_tokens) a request must fit. Nothing about hosts or workers."""

    authentication_classes = []
    permission_classes = [AllowAny]

    class OutputSerializer(serializers.Serializer):
        status = serializers.ChoiceField(choices=["ok", "unavailable"])
        effective_context_limit = serializers.IntegerField(
            allow_null=True, help_text="Most tokens (prompt + max_tokens) one request may use; null while unavailable.")

    @extend_schema(responses={200: OutputSerializer, 503: OutputSerializer})
    def get(self, request):
        body = health_get()
        code = status.HTTP_200_OK if body["status"] == "ok" else status.HTTP_503_SERVICE_UNAVAILABLE
        response = Response(self.OutputSerializer(body).data, status=code)
        response["Cache-Control"] = "no-store"
        if code == status.HTTP_503_SERVICE_UNAVAILABLE:
            unavailable_log(request, response)  # expected while a stack starts: a warning, not Django's error
        return response
