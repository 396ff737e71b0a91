import openai
import pytest


@pytest.fixture(scope="module")
def client(openai_server):
    """The official openai client on the shared server (a module with a server of its own overrides it)."""
    return openai.OpenAI(base_url=openai_server.base_url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id
