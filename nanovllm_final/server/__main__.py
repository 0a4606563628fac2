from nanovllm_final.server.cli import main

if __name__ == "__main__":
    main()
