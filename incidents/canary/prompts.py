"""Canary tenants, sentinels and prompts of a chosen token length (counted by the API's own tokenizer)."""
import secrets
import string

from inference.arith import cdiv
from kvserve.chat.tokenizer import tokenizer_get
from kvserve.tenants.models import ApiKey, Tenant
from kvserve.tenants.services import api_key_create

TENANT_A = "canary-a"  # plants sentinels
TENANT_B = "canary-b"  # concurrent traffic, edge-of-limit and overlong prompts
# Sentinel: three letter-digit-letter groups, e.g. "K7Q-B2X-M9T" (~38 bits). The served model (SmolLM2-135M,
# greedy) repeats this shape exactly when asked; longer or digit-heavy shapes it garbles more often.
_LETTERS, _DIGITS = string.ascii_uppercase, string.digits
ECHO_MAX_TOKENS = 24  # "The secret code is K7Q-B2X-M9T." plus room


def new_sentinel() -> str:
    return "-".join(secrets.choice(_LETTERS) + secrets.choice(_DIGITS) + secrets.choice(_LETTERS) for _ in range(3))


def echo_messages(sentinel: str) -> list[dict]:
    return [{"role": "user", "content": f"Repeat exactly: the secret code is {sentinel}"}]


def canary_key(tenant_name: str) -> ApiKey:
    """The canary tenant's active key, created (tenant and key) the first time; idempotent. Canary tenants are
    exempt from fair share (0: no limit): their probes go to the edge of the window on purpose."""
    tenant, _ = Tenant.objects.get_or_create(name=tenant_name, defaults={"store_text": False})
    if tenant.max_in_flight != 0 or tenant.kv_share != 0:
        Tenant.objects.filter(pk=tenant.pk).update(max_in_flight=0, kv_share=0)
    key = tenant.api_keys.filter(revoked_at__isnull=True).order_by("created_at").first()
    if key is None:
        key, _raw = api_key_create(tenant_name)  # the raw key is not needed: canaries call the services
    return key


def prompt_tokens(messages: list[dict]) -> int:
    tokenizer, _, _ = tokenizer_get()
    return len(tokenizer.encode(tokenizer.render_chat(messages)))


_FILLER = "The canary reads a long and uneventful report about quarterly figures. "


def long_messages(min_tokens: int, sentinel: str = "") -> tuple[list[dict], int]:
    """Messages whose prompt is at least `min_tokens` tokens (and not much more); (messages, token count)."""
    head = f"Repeat exactly: the secret code is {sentinel}. " if sentinel else "Summarise this report. "

    def build(reps: int) -> list[dict]:
        return [{"role": "user", "content": head + _FILLER * reps}]

    base, one = prompt_tokens(build(0)), prompt_tokens(build(1))
    per = max(1, one - base)
    reps = max(0, cdiv(min_tokens - base, per))
    n = prompt_tokens(build(reps))
    while n < min_tokens:
        reps += max(1, (min_tokens - n) // per)
        n = prompt_tokens(build(reps))
    return build(reps), n
