"""SECRET_KEY, the handoff and prompt-hash keys, the metrics token, DEBUG, allowed hosts, HTTPS hardening."""
from kvserve.secrets import secret_get
from inference.settings import env_bool, env_int, env_list, env_parsed
from kvserve.chat.salt import share_groups_parse

# Env first (DJANGO_SECRET_KEY / KVSERVE_HANDOFF_KEY / ...), else generated once into var/secrets.json.
SECRET_KEY = secret_get("DJANGO_SECRET_KEY")
KVSERVE_HANDOFF_KEY = secret_get("KVSERVE_HANDOFF_KEY")
# Keys ChatRequest.prompt_hash (HMAC-SHA256): equal prompts compare equal within a deployment, but a short
# prompt cannot be found by hashing guesses without this key. Every web host must share it.
KVSERVE_PROMPT_HASH_KEY = secret_get("KVSERVE_PROMPT_HASH_KEY")
# /metrics asks for `Authorization: Bearer <token>` (staff sessions are let in too): per-tenant prefix-cache
# and page figures are no one else's business. Generated on first run unless set; `make run` prints it.
KVSERVE_METRICS_TOKEN = secret_get("KVSERVE_METRICS_TOKEN")

DEBUG = env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver,[::1]")
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", "")

# Served over TLS? Set DJANGO_HTTPS=1. The embedded default serves plain HTTP on loopback.
HTTPS = env_bool("DJANGO_HTTPS", False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = SECURE_SSL_REDIRECT = HTTPS
SECURE_HSTS_SECONDS = env_int("DJANGO_HSTS_SECONDS", 0, low=0) if HTTPS else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = HTTPS and env_bool("DJANGO_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = HTTPS and env_bool("DJANGO_HSTS_PRELOAD", False)
# Load balancers probe health over plain HTTP inside the network; /healthz says nothing secret.
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]
if env_bool("DJANGO_BEHIND_PROXY", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
# Keys the prefix-cache salts (HMAC-SHA256 of the tenant): a cache scope no request field can name or copy.
KVSERVE_PREFIX_SALT_KEY = secret_get("KVSERVE_PREFIX_SALT_KEY")


def _share_groups_checked(text: str) -> str:
    share_groups_parse(text)  # ValueError when malformed: refused at start, named
    return text


# Tenants that share one prefix-cache scope, by operator choice only: "group=tenant1,tenant2;other=t3,t4".
# Off (empty) by default: a shared scope lets its tenants time each other's cache hits (see README).
KVSERVE_PREFIX_SHARE_GROUPS = env_parsed("KVSERVE_PREFIX_SHARE_GROUPS", "", _share_groups_checked,
                                         "group=tenant1,tenant2;other=t3,t4")
