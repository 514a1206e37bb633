"""Project-level HTTP endpoints: /healthz."""
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from kvserve.selectors import health_get


class HealthzApi(APIView):
    """200 when a live prefill and a live decode worker can serve; 503 (same body + error) otherwise."""

    authentication_classes = []
    permission_classes = [AllowAny]

    class OutputSerializer(serializers.Serializer):
        workers = serializers.ListField(child=serializers.DictField())
        window = serializers.IntegerField()
        effective_context_limit = serializers.IntegerField(allow_null=True)
        error = serializers.CharField(required=False)

    @extend_schema(responses={200: OutputSerializer, 503: OutputSerializer})
    def get(self, request):
        body = health_get()
        code = status.HTTP_503_SERVICE_UNAVAILABLE if "error" in body else status.HTTP_200_OK
        return Response(self.OutputSerializer(body).data, status=code)
