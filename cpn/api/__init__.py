"""The REST face (aiohttp): thin handlers over layer functions."""
