"""The router service (`baton router`): OpenAI surface in front of workers. No torch here."""
