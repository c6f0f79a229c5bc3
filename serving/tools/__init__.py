"""Tool calling (docs/tools.md): how calls are written in the model's output (`formats`), the
constraint that makes them parse (`constraint`), the prompt that offers the tools (`prompt`),
and the parser that reads calls back out, whole or streamed (`parser`)."""
