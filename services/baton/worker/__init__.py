"""The worker service: the engine behind the OpenAI HTTP surface (`baton serve`)."""
