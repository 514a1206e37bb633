from django.apps import AppConfig


class ChatConfig(AppConfig):
    name = "kvserve.chat"
    label = "chat"
    verbose_name = "Chat requests"
