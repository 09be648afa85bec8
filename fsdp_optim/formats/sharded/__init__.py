"""Our sharded checkpoint: ``manifest.json`` (``manifest.py`` records, ``manifest_json.py`` exact JSON) and one
safetensors rank file per rank (``rank_file.py``, chunk checksums in ``segments.py``); ``reader.py`` reads every
format by byte range, ``writer.py`` writes format 3 through the one staged writer."""
