"""The OpenAI surface: request parsing and validation, response shapes, OpenAPI, tokenize, tools, logprobs, limits."""
