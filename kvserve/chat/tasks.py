"""Thin Celery tasks: each takes a request id (and the payload the next stage needs) and calls a service."""
from celery import shared_task

from kvserve.chat import services


@shared_task(name="inference.prefill", ignore_result=True)
def prefill(request_id: str, prompt_ids: list[int]) -> None:
    services.chat_request_prefill(request_id, prompt_ids)


@shared_task(name="inference.decode", ignore_result=True)
def decode(request_id: str, prompt_ids: list[int], handoff: dict) -> None:
    services.chat_request_decode(request_id, prompt_ids, handoff)


@shared_task(name="kvserve.reap", ignore_result=True)
def reap() -> dict:
    return services.requests_reap_orphans()
