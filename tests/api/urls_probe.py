"""Test-only URLconf: the real routes plus probe views that exercise auth and the error format."""
from django.urls import path
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from kvserve.errors import ApiError
from kvserve.urls import handler404, handler500, urlpatterns as real  # noqa: F401


class WhoAmIApi(APIView):
    def get(self, request):
        return Response({"tenant": request.user.tenant.name, "key": request.auth.prefix})


class ValidateApi(APIView):
    class InputSerializer(serializers.Serializer):
        model = serializers.CharField()
        max_tokens = serializers.IntegerField(min_value=1)

    def post(self, request):
        self.InputSerializer(data=request.data).is_valid(raise_exception=True)
        raise ApiError("This model's maximum context length is 10 tokens.",
                       param="messages", code="context_length_exceeded")


class BoomApi(APIView):
    def get(self, request):
        raise RuntimeError("secret internal detail")


urlpatterns = real + [
    path("probe/whoami", WhoAmIApi.as_view()),
    path("probe/validate", ValidateApi.as_view()),
    path("probe/boom", BoomApi.as_view()),
]
