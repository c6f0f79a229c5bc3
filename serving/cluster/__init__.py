"""`tercel serve --replicas N`: engine replicas behind Ray Serve with prefix-affinity routing.

  flags.py          the flags, and the check that Ray Serve is installed (imports no Ray)
  replicas.py       the Serve application and its deployment (TercelReplica, app_builder)
  prefix_router.py  the request router: a replica by the prompt's prefix, or by load
  prefix_index.py   which replica has served which prefix blocks
  asgi_call.py      one HTTP request handed to a replica's FastAPI app in process
"""
