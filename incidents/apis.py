"""GET /api/pools/: the dashboard's data as JSON, for staff users logged in to the admin (session cookie)."""
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions
from rest_framework.authentication import SessionAuthentication
from rest_framework.permissions import IsAdminUser
from rest_framework.response import Response
from rest_framework.views import APIView

from incidents.selectors import dashboard_get


class PoolsApi(APIView):
    authentication_classes = [SessionAuthentication]
    permission_classes = [IsAdminUser]

    def permission_denied(self, request, message=None, code=None):
        raise exceptions.PermissionDenied("staff only: log in at /admin/ and send the session cookie")

    @extend_schema(exclude=True)  # an operator endpoint, not part of the tenant API
    def get(self, request):
        response = Response(dashboard_get(user=request.user))
        response["Cache-Control"] = "no-store"
        return response
