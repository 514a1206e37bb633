"""Routes of the chat API: OpenAI-compatible under /v1/, vLLM's /tokenize, /detokenize and /version, a tenant's
own requests under /api/requests/."""
from django.urls import path

from kvserve.chat.apis import (ChatCompletionsApi, ChatRequestDetailApi, ChatRequestStreamApi, CompletionsApi,
                               ModelDetailApi, ModelListApi)
from kvserve.chat.tokenize_apis import DetokenizeApi, TokenizeApi, VersionApi

urlpatterns = [
    path("v1/chat/completions", ChatCompletionsApi.as_view(), name="chat-completions"),
    path("v1/completions", CompletionsApi.as_view(), name="completions"),
    path("v1/models", ModelListApi.as_view(), name="models"),
    path("v1/models/<str:model_id>", ModelDetailApi.as_view(), name="model-detail"),
    path("tokenize", TokenizeApi.as_view(), name="tokenize"),
    path("detokenize", DetokenizeApi.as_view(), name="detokenize"),
    path("version", VersionApi.as_view(), name="version"),
    path("api/requests/<str:request_id>", ChatRequestDetailApi.as_view(), name="chat-request-detail"),
    path("api/requests/<str:request_id>/stream", ChatRequestStreamApi.as_view(), name="chat-request-stream"),
]
