"""Apps, middleware, templates, static files (whitenoise), DRF + drf-spectacular, logging."""
from kvserve.paths import BASE_DIR
from inference.logs import LOG_FORMATS, logging_config
from inference.settings import env_choice

INSTALLED_APPS = [
    "kvserve.admin_site.KvserveAdminConfig",  # django.contrib.admin; actions need a permission
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "kvserve.tenants",
    "kvserve.chat",
    "incidents",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "kvserve.storable.StorableUrlMiddleware",  # a NUL or lone surrogate in a URL: 400, never a query
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "kvserve.urls"
WSGI_APPLICATION = "kvserve.wsgi.application"
ASGI_APPLICATION = "kvserve.asgi.application"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # Not the manifest variant: pages render before (or without) collectstatic, e.g. in tests.
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# Serve app static (admin, swagger-ui from drf-spectacular-sidecar) even without collectstatic.
WHITENOISE_USE_FINDERS = True

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["kvserve.tenants.authentication.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "EXCEPTION_HANDLER": "kvserve.errors.openai_exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}

KVSERVE_VERSION = "0.1.0"  # GET /version and the OpenAPI schema's version

SPECTACULAR_SETTINGS = {
    "TITLE": "kvserve",
    "DESCRIPTION": "OpenAI-compatible chat completions on an ownership-guarded paged KV cache.",
    "VERSION": KVSERVE_VERSION,
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    # Swagger UI / ReDoc assets come from the drf-spectacular-sidecar wheel: no CDN, works offline.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums",
                             "kvserve.chat.schema.closed_request_bodies"],
}

LOG_LEVEL = env_choice("KVSERVE_LOG_LEVEL", "info", ("debug", "info", "warning", "error", "critical")).upper()
# every line names its process (role, pid, worker id: inference/logs.py); `json`: one JSON object per line
LOG_FORMAT = env_choice("KVSERVE_LOG_FORMAT", "plain", LOG_FORMATS)
LOGGING = logging_config(LOG_LEVEL, LOG_FORMAT)  # Celery's workers and beat keep it too (kvserve/logs.py)
