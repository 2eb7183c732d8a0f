"""The SGLang embedding store and plugin, against SGLang's wheel."""
