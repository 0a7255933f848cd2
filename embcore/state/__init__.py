"""This process's rows and slots: the store, the slow tier's cache, dynamic vocabularies,
DTensor views."""
