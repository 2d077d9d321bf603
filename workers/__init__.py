"""Stage workers (encode, denoise, decode) and the queue and record modules that feed them.

``messages``, ``streams``, ``records`` and ``submit`` import no model code: they are the whole
interface the API has to the workers.
"""
