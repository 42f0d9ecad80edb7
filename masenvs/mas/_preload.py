"""Everything a design run imports, loaded once by the design sandbox's zygote.

A run's private /tmp (and a closed home) may hide the source tree, so what is imported
lazily at the first request must be imported here, before any run forks.
"""

import anyio._backends._asyncio  # noqa: F401
import h11  # noqa: F401
import httpcore._async.connection_pool  # noqa: F401
import httpcore._backends.anyio  # noqa: F401
import httpx
import openai
import openai.resources.chat.completions  # noqa: F401

import masenvs.mas.design  # noqa: F401
from masenvs.mas import blocks, graph, llm  # noqa: F401

# Touch the client's lazy attributes (resources, type adapters) without sending anything.
_client = openai.AsyncOpenAI(
    base_url="http://gate/v1",
    api_key="-",
    http_client=httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds="/nonexistent", verify=False)
    ),
)
_client.chat.completions  # noqa: B018
del _client
