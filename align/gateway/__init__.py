"""The gateway wing: OpenAI-compatible endpoints over the policy's sampler (``server``), the token-exact capture of
an agent's requests (``capture``) and agent programs as an episode source (``agents``)."""
